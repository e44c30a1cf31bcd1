"""A request as the block manager sees it: tokens (or their block hashes) and progress.

A request caches its block hashes and extends them incrementally: during decode only
newly filled blocks are hashed, and a preempted request keeps its hashes so it can hit
its own cache when it resumes. Real traces carry block hash ids instead of tokens, so a
request can also be built from precomputed hashes (`Request.from_block_hashes`); the
manager treats both kinds alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvtier.hashing import (
    BlockHashSpec,
    HashAlgorithm,
    check_mm_inputs,
    check_token_ids,
    hash_blocks,
)
from kvtier.types import BlockHash
from kvtier.validate import positive_int


class Request:
    """One sequence: prompt, appended output tokens, options and cached block hashes.

    `num_computed_tokens` is the scheduler's progress counter: `KVCacheManager` reads
    it and never advances it (as in vLLM); only `KVCacheManager.preempt` resets it.
    """

    __slots__ = (
        "_block_hashes",
        "_hash_block_size",
        "_hash_spec",
        "_num_tokens",
        "_precomputed",
        "_token_ids",
        "cache_salt",
        "lora_name",
        "lora_path",
        "mm_inputs",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        mm_inputs: Sequence[tuple[str, int, int]] = (),
        block_size: int | None = None,
        hash_algorithm: HashAlgorithm = "sha256_cbor",
    ) -> None:
        tokens = check_token_ids(prompt_token_ids, f"request {request_id!r}: prompt_token_ids")
        self._init_common(request_id, len(tokens), cache_salt, lora_name, lora_path)
        self._token_ids: list[int] | None = tokens
        self._precomputed = False
        self.mm_inputs = check_mm_inputs(mm_inputs)  # at once, not at the first hashing
        for item in self.mm_inputs:
            if item.offset + item.length > len(tokens):
                raise ValueError(
                    f"multimodal input {item} ends after the prompt ({len(tokens)} tokens)"
                )
        self._block_hashes: list[BlockHash] = []
        self._hash_spec: BlockHashSpec | None = None
        self._hash_block_size = 0
        if block_size is not None:
            self._hash_spec = self._make_spec(block_size, hash_algorithm)
            self._hash_block_size = block_size

    def _init_common(
        self,
        request_id: str,
        num_prompt_tokens: int,
        cache_salt: str | None,
        lora_name: str | None,
        lora_path: str | None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if num_prompt_tokens < 1:
            raise ValueError(f"a request needs at least 1 prompt token, got {num_prompt_tokens}")
        if lora_path is not None and lora_name is None:
            raise ValueError(f"lora_path {lora_path!r} given without a lora_name")
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._num_tokens = num_prompt_tokens
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.lora_path = lora_path
        self.num_computed_tokens = 0
        self.num_preemptions = 0

    @classmethod
    def from_block_hashes(
        cls,
        request_id: str,
        block_hashes: Iterable[BlockHash],
        num_prompt_tokens: int,
        *,
        block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
    ) -> Request:
        """A request known only by the hashes of its FULL prompt blocks (e.g. a trace).

        Options are metadata here (the hashes already encode them). Blocks filled later
        by output tokens get no hash, so they are never cached.
        """
        hashes = list(block_hashes)
        positive_int("block_size", block_size)
        request = cls.__new__(cls)
        request._init_common(request_id, num_prompt_tokens, cache_salt, lora_name, lora_path)
        num_full = num_prompt_tokens // block_size
        if len(hashes) > num_full:
            raise ValueError(
                f"{len(hashes)} block hashes given but {num_prompt_tokens} prompt tokens fill "
                f"only {num_full} full blocks of {block_size}: hashes are for full blocks only"
            )
        request._token_ids = None
        request._precomputed = True
        request.mm_inputs = ()
        request._block_hashes = hashes
        request._hash_spec = None
        request._hash_block_size = block_size
        return request

    # --- tokens ---------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_output_tokens(self) -> int:
        return self._num_tokens - self.num_prompt_tokens

    @property
    def has_token_ids(self) -> bool:
        """False for a request built from block hashes (its tokens are unknown)."""
        return self._token_ids is not None

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt then output tokens (a live view: do not mutate)."""
        if self._token_ids is None:
            raise ValueError(f"request {self.request_id!r} was built from block hashes")
        return self._token_ids

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def append_output_token_ids(self, token_ids: int | np.integer[Any] | Sequence[int]) -> None:
        """Append generated tokens (decode); a hash-built request only counts them."""
        where = f"request {self.request_id!r}: output token ids"
        if isinstance(token_ids, int | np.integer):  # a sampler's numpy scalar too
            new = check_token_ids([token_ids], where)
        else:
            new = check_token_ids(token_ids, where)
        if self._token_ids is not None:
            self._token_ids.extend(new)
        self._num_tokens += len(new)

    # --- block hashes ---------------------------------------------------------------

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Hashes of every full block so far (needs a block size, from init or a manager)."""
        if self._precomputed:
            return self._block_hashes
        if self._hash_spec is None:
            raise ValueError(
                f"request {self.request_id!r} has no block size yet: pass block_size= or "
                "hand it to a KVCacheManager first"
            )
        return self.get_block_hashes(self._hash_spec.block_size, self._hash_spec.algorithm)

    def get_block_hashes(self, block_size: int, algorithm: HashAlgorithm) -> list[BlockHash]:
        """The cached hashes, extended to the current full blocks (a live list: read only)."""
        if self._precomputed:
            if block_size != self._hash_block_size:
                raise ValueError(
                    f"request {self.request_id!r} carries hashes of {self._hash_block_size}-"
                    f"token blocks, not {block_size}"
                )
            return self._block_hashes
        spec = self._hash_spec
        if spec is None or spec.block_size != block_size or spec.algorithm != algorithm:
            self._hash_spec = spec = self._make_spec(block_size, algorithm)
            self._hash_block_size = block_size
            self._block_hashes = []
        hashes = self._block_hashes
        num_hashed = len(hashes)
        if (num_hashed + 1) * block_size <= self._num_tokens:
            assert self._token_ids is not None
            tokens = self._token_ids[num_hashed * block_size : self._num_tokens]
            hashes.extend(hash_blocks(spec, tokens, hashes[-1] if hashes else None, num_hashed))
        return hashes

    def _make_spec(self, block_size: int, algorithm: HashAlgorithm) -> BlockHashSpec:
        return BlockHashSpec(
            block_size=block_size,
            cache_salt=self.cache_salt,
            lora_name=self.lora_name,
            lora_path=self.lora_path,
            mm_inputs=self.mm_inputs,
            algorithm=algorithm,
        )

    def __repr__(self) -> str:
        kind = "hashes" if self._precomputed else "tokens"
        return (
            f"Request({self.request_id!r}, {kind}, num_tokens={self._num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
