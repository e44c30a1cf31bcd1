"""What the connector tells the manager of each request before vLLM walks its keys: its
length and its keys in order.

vLLM asks the manager about one key at a time, and a decision taken at the first key
of a run (wait for Redis, load a disk run or recompute it) is only as good as what it
knows of the keys after it. The connector's `get_num_new_matched_tokens` has the whole
request (`KvtierConnector.get_num_new_matched_tokens`), so it notes the request here
first; the Redis runs (`remote_runs`) and the disk runs (`disk_runs`) read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key

from kvtier.types import BlockHash

_S = TypeVar("_S")


def request_state(req_context: ReqContext, kind: type[_S]) -> _S:
    """The request's state of class `kind` (vLLM keeps one of each class in its request
    context), made empty at its first use."""
    state: _S | None = req_context.get_state(kind)
    if state is None:
        state = kind()
        req_context.set_state(state)
    return state


@dataclass(frozen=True)
class PromptChain:
    """A request's offload keys (of its first KV-cache group), from vLLM's block hashes
    as its scheduler side makes them: chunk i's key is the hash of its last block with
    the group's index. Read only where a decision needs them (`Prompts.run_from`)."""

    block_hashes: Sequence[bytes]
    hashes_per_chunk: int
    group_idx: int

    def key(self, chunk: int) -> OffloadKey | None:
        """Chunk `chunk`'s key; None past the prompt's last whole chunk."""
        i = (chunk + 1) * self.hashes_per_chunk - 1
        if chunk < 0 or i >= len(self.block_hashes):
            return None
        return make_offload_key(self.block_hashes[i], self.group_idx)


class Prompts:
    """The requests in flight that the connector noted (`note`), until they finish
    (`forget`). `hash_of`: a key's block hash as the tiers name it."""

    def __init__(self, tokens_per_block: int, hash_of: Callable[[OffloadKey], BlockHash]):
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block={tokens_per_block}; at least 1")
        self.tokens_per_block = tokens_per_block
        self._hash_of = hash_of
        self._tokens: dict[str, int] = {}  # by request id
        self._chains: dict[str, PromptChain] = {}  # by request id

    def note(self, req_id: str, num_tokens: int, chain: PromptChain | None = None) -> None:
        self._tokens[req_id] = num_tokens
        if chain is not None:
            self._chains[req_id] = chain

    def forget(self, req_id: str) -> None:
        self._tokens.pop(req_id, None)
        self._chains.pop(req_id, None)

    def blocks_to_end(self, key: OffloadKey, req_context: ReqContext) -> int | None:
        """The request's whole blocks from `key` (whose end token vLLM records) to its
        last, `key`'s included; None if its length is unknown."""
        tokens = self._tokens.get(req_context.req_id)
        end_token = req_context.get_offload_key_position(key)
        if tokens is None or end_token is None:
            return None
        return 1 + max(tokens - int(end_token), 0) // self.tokens_per_block

    def end(self, key: OffloadKey, req_context: ReqContext, pos: int) -> int | None:
        """One past the position of the request's last whole block, from the key at
        `pos`; None if unknown."""
        blocks = self.blocks_to_end(key, req_context)
        return None if blocks is None else pos + blocks

    def run_from(
        self, key: OffloadKey, req_context: ReqContext, holds: Callable[[BlockHash], bool]
    ) -> int | None:
        """How many of the request's blocks from `key` on, in the order of its keys,
        `holds`; None where its keys are not known or do not match."""
        chain = self._chains.get(req_context.req_id)
        end_token = req_context.get_offload_key_position(key)
        if chain is None or end_token is None:
            return None
        chunk = int(end_token) // self.tokens_per_block - 1
        if chain.key(chunk) != key:
            return None
        run = 0
        while (k := chain.key(chunk + run)) is not None and holds(self._hash_of(k)):
            run += 1
        return run
