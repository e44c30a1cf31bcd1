"""Chained block hashes, byte-identical to vLLM's `sha256_cbor` scheme.

`hash_i = H([hash_{i-1} or NONE_HASH, tuple(tokens of block i), extra_keys_i])` with
`H(x) = sha256(cbor2.dumps(x, canonical=True))` (docs/semantics.md section 1). `xxh3_128`
is an opt-in digest over the very same CBOR bytes.

Why a hand-rolled encoder: cbor2 costs about half a microsecond per integer, so a
100k-token prompt took ~100 ms. Canonical CBOR of `[bytes, [uint...], extra]` is a
plain concatenation of each element's encoding, so the token part is encoded for the
whole request at once with numpy and sliced per block; cbor2 still encodes the rare
extra keys and every input the fast path does not cover (negative or huge token
ids). Tests compare both paths against cbor2 byte for byte.
"""

from __future__ import annotations

import array
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast

import cbor2
import numpy as np
import xxhash

from kvtier.types import BlockHash
from kvtier.validate import positive_int

HashAlgorithm = Literal["sha256_cbor", "xxh3_128"]
HASH_ALGORITHMS: tuple[HashAlgorithm, ...] = ("sha256_cbor", "xxh3_128")
NONE_HASH_SEED = "vllm-none-hash"

_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "sha256_cbor": lambda data: hashlib.sha256(data).digest(),
    "xxh3_128": xxhash.xxh3_128_digest,
}


class MultiModalInput(NamedTuple):
    """A multimodal item occupying tokens `[offset, offset + length)` of a request."""

    identifier: str
    offset: int
    length: int


def digest_function(algorithm: HashAlgorithm) -> Callable[[bytes], bytes]:
    """The raw digest (over CBOR bytes) of a hash algorithm name."""
    try:
        return _DIGESTS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown hash algorithm {algorithm!r}; allowed: {', '.join(HASH_ALGORITHMS)}"
        ) from None


# Token ids are vocabulary indices: [0, 2**32) covers every tokenizer in use, and
# is what the batched encoder handles. Requests and token traces refuse others.
MAX_TOKEN_ID = (1 << 32) - 1
# Negative ids are placeholders (vLLM's prefix-caching tests give multimodal inputs -1),
# which vLLM's manager takes and hashes like any token; int32's range, as vLLM holds them.
MIN_TOKEN_ID = -(1 << 31)


def check_token_ids(token_ids: Sequence[int] | Any, where: str = "token ids") -> list[int]:
    """The tokens as a new list, refused (naming the first bad one and its position)
    unless every one is an integer in [MIN_TOKEN_ID, MAX_TOKEN_ID] (numpy integers are kept as
    given: hashing takes them)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype.kind not in "iu" or token_ids.ndim != 1:
            raise ValueError(
                f"{where} must be a flat sequence of integers, got an array of dtype "
                f"{token_ids.dtype} and shape {token_ids.shape}"
            )
        tokens: list[int] = token_ids.tolist()
    elif isinstance(token_ids, str | bytes):
        raise ValueError(f"{where} must be a sequence of integers, got {token_ids!r:.40}")
    else:
        tokens = list(token_ids)
    try:  # the common case checked in C: ints that fit in 64 bits, then numpy's min/max
        values = np.frombuffer(array.array("q", tokens), dtype=np.int64)
        if not values.size or (values.min() >= MIN_TOKEN_ID and values.max() <= MAX_TOKEN_ID):
            return tokens
    except (OverflowError, TypeError):
        pass
    for position, token in enumerate(tokens):
        if (
            isinstance(token, bool)
            or not isinstance(token, int | np.integer)
            or not MIN_TOKEN_ID <= token <= MAX_TOKEN_ID
        ):
            raise ValueError(
                f"{where}: token {position} is {token!r}; token ids are integers in "
                f"[{MIN_TOKEN_ID}, {MAX_TOKEN_ID}]"
            )
    return [int(t) for t in tokens]


def hash_object(obj: Any, algorithm: HashAlgorithm = "sha256_cbor") -> BlockHash:
    """`H(obj)`: the digest of obj's canonical CBOR encoding."""
    return BlockHash(digest_function(algorithm)(cbor2.dumps(obj, canonical=True)))


def _compute_none_hash(algorithm: HashAlgorithm) -> BlockHash:
    # PYTHONHASHSEED lets separate processes agree on the chain's root (vLLM's rule);
    # unlike vLLM the unset case is a fixed seed, so hashes are reproducible by default.
    return hash_object(os.environ.get("PYTHONHASHSEED", NONE_HASH_SEED), algorithm)


_NONE_HASHES: dict[str, BlockHash] = {a: _compute_none_hash(a) for a in HASH_ALGORITHMS}
NONE_HASH: BlockHash = _NONE_HASHES["sha256_cbor"]


def none_hash(algorithm: HashAlgorithm = "sha256_cbor") -> BlockHash:
    """The parent hash of a request's first block (read from the environment at import)."""
    digest_function(algorithm)
    return _NONE_HASHES[algorithm]


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
    algorithm: HashAlgorithm = "sha256_cbor",
) -> BlockHash:
    """One block's hash the slow, obvious way (reference for the batched path)."""
    parent = parent_hash if parent_hash else none_hash(algorithm)
    return hash_object((parent, tuple(token_ids), extra_keys), algorithm)


@dataclass(frozen=True, slots=True)
class BlockHashSpec:
    """Everything besides the tokens that goes into a request's block hashes."""

    block_size: int
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    mm_inputs: tuple[MultiModalInput, ...] = ()
    algorithm: HashAlgorithm = "sha256_cbor"

    def __post_init__(self) -> None:
        positive_int("block_size", self.block_size)
        if self.lora_path is not None and self.lora_name is None:
            raise ValueError(f"lora_path {self.lora_path!r} given without a lora_name")
        digest_function(self.algorithm)
        object.__setattr__(self, "mm_inputs", check_mm_inputs(self.mm_inputs))

    @property
    def has_extra_keys(self) -> bool:
        return bool(self.cache_salt) or self.lora_name is not None or bool(self.mm_inputs)

    def extra_keys(self, block_index: int) -> tuple[Any, ...] | None:
        """`extra_keys_i` of docs/semantics.md: LoRA, overlapping mm inputs, then the salt.

        An empty salt counts as no salt, as in vLLM (which tests the salt's truth).
        """
        start = block_index * self.block_size
        end = start + self.block_size
        keys: list[tuple[Any, ...]] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path))
        for identifier, offset, length in self.mm_inputs:
            if offset >= end:
                break
            if offset + length > start:
                keys.append(("mm", identifier, offset - start))
        if block_index == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None


def check_mm_inputs(mm_inputs: Sequence[Any]) -> tuple[MultiModalInput, ...]:
    """The items as `MultiModalInput`s, refused unless in position order without overlap."""
    items = tuple(MultiModalInput(*item) for item in mm_inputs)
    previous_end = 0
    for item in items:
        if not isinstance(item.offset, int) or item.offset < 0 or item.length < 1:
            raise ValueError(f"multimodal input needs offset >= 0 and length >= 1, got {item}")
        if item.offset < previous_end:
            raise ValueError(
                f"multimodal inputs must be in position order without overlap; {item} "
                f"starts before the previous one ends at {previous_end}"
            )
        previous_end = item.offset + item.length
    return items


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    mm_inputs: Sequence[tuple[str, int, int]] = (),
    algorithm: HashAlgorithm = "sha256_cbor",
) -> list[BlockHash]:
    """The chained hashes of every FULL block of `token_ids` (a partial tail gets none)."""
    spec = BlockHashSpec(
        block_size=block_size,
        cache_salt=cache_salt,
        lora_name=lora_name,
        lora_path=lora_path,
        mm_inputs=tuple(MultiModalInput(*m) for m in mm_inputs),
        algorithm=algorithm,
    )
    return hash_blocks(spec, token_ids, None, 0)


def hash_blocks(
    spec: BlockHashSpec,
    token_ids: Sequence[int],
    parent_hash: BlockHash | None,
    first_block: int,
) -> list[BlockHash]:
    """Hash the full blocks of `token_ids`, whose first token starts block `first_block`.

    This is the incremental entry point: a growing request passes only its tokens
    from the first unhashed block on, plus the hash of the block before it.
    """
    block_size = spec.block_size
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    tokens = token_ids[: num_blocks * block_size]
    parent = parent_hash if parent_hash else none_hash(spec.algorithm)
    # numpy's fixed cost (~50 us) only pays off beyond a few blocks (decode hashes one).
    encoded = _encode_uints(tokens, block_size) if num_blocks >= _MIN_BATCH_BLOCKS else None
    if encoded is None:
        return _hash_blocks_cbor2(spec, tokens, parent, first_block)
    data, bounds = encoded
    digest = digest_function(spec.algorithm)
    array_head = _head(0x80, block_size)
    # Every chained parent after the first is one of our digests: one fixed head.
    digest_head = _head(0x40, len(digest(b"")))
    parent_head = _head(0x40, len(parent))
    hashes: list[bytes] = []
    previous: bytes = parent
    extra_tail = b"\xf6"  # CBOR null: the common case of no extra keys
    with_extras = spec.has_extra_keys
    join = b"".join
    for k in range(num_blocks):
        if with_extras:
            extra_tail = cbor2.dumps(spec.extra_keys(first_block + k), canonical=True)
        chunk = data[bounds[k] : bounds[k + 1]]
        previous = digest(join((b"\x83", parent_head, previous, array_head, chunk, extra_tail)))
        parent_head = digest_head
        hashes.append(previous)
    return cast(list[BlockHash], hashes)  # NewType: same objects, no per-block wrapping


def _hash_blocks_cbor2(
    spec: BlockHashSpec, tokens: Sequence[int], parent: BlockHash, first_block: int
) -> list[BlockHash]:
    """The general path through cbor2 itself (negative or > 64-bit token ids)."""
    digest = digest_function(spec.algorithm)
    size = spec.block_size
    hashes: list[BlockHash] = []
    for k in range(len(tokens) // size):
        block = tuple(tokens[k * size : (k + 1) * size])
        for t in block:
            if isinstance(t, bool) or not isinstance(t, int | np.integer):
                raise ValueError(f"token ids must be ints, got {t!r}")
        block = tuple(int(t) for t in block)
        key = (parent, block, spec.extra_keys(first_block + k))
        parent = BlockHash(digest(cbor2.dumps(key, canonical=True)))
        hashes.append(parent)
    return hashes


def _head(major: int, length: int) -> bytes:
    """A CBOR major-type head with its shortest length argument."""
    if length < 24:
        return bytes((major | length,))
    for code, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if length < 1 << (8 * width):
            return bytes((major | code,)) + length.to_bytes(width, "big")
    raise ValueError(f"CBOR length {length} does not fit in 64 bits")


_MIN_BATCH_BLOCKS = 8

# CBOR's unsigned integer forms above the one-byte form: (head byte, payload bytes).
_UINT_FORMS = ((0x18, 1), (0x19, 2), (0x1A, 4))
_UINT_LIMITS = np.array([24, 1 << 8, 1 << 16], dtype=np.int64)
_UINT_SIZES = np.array([1, 2, 3, 5], dtype=np.int64)


def _as_int_array(tokens: Sequence[int]) -> np.ndarray[Any, np.dtype[np.int64]] | None:
    """Tokens as int64, or None when only cbor2 can encode them (beyond int64)."""
    if isinstance(tokens, np.ndarray):
        values = tokens
    else:
        try:  # array.array converts a list of ints faster than numpy does
            values = np.frombuffer(array.array("q", tokens), dtype=np.int64)
        except (OverflowError, TypeError):
            return None  # huge ints or non-ints: cbor2's path checks each token
    if values.dtype.kind not in "iu" or values.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence of ints, got dtype {values.dtype}")
    if values.dtype.kind == "u" and values.size and int(values.max()) >= 1 << 32:
        return None
    return values.astype(np.int64, copy=False)


def _encode_uints(tokens: Sequence[int], block_size: int) -> tuple[bytes, list[int]] | None:
    """Canonical CBOR of every token, concatenated, plus each block's start offset.

    Returns None when a token is not an int in [0, 2**32) (the caller falls back).
    """
    values = _as_int_array(tokens)
    if values is None or (values.size and (values.min() < 0 or values.max() >= 1 << 32)):
        return None
    form = np.searchsorted(_UINT_LIMITS, values, side="right")
    ends = np.cumsum(_UINT_SIZES[form])
    starts = ends - _UINT_SIZES[form]
    out = np.empty(int(ends[-1]) if ends.size else 0, dtype=np.uint8)
    small = form == 0
    out[starts[small]] = values[small]
    for index, (head, width) in enumerate(_UINT_FORMS, start=1):
        mask = form == index
        if not mask.any():
            continue
        where, chosen = starts[mask], values[mask]
        out[where] = head
        for j in range(width):
            out[where + 1 + j] = (chosen >> (8 * (width - 1 - j))) & 0xFF
    bounds = np.concatenate((starts[::block_size], ends[-1:])).tolist()
    return out.tobytes(), bounds
