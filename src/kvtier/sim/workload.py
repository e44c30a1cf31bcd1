"""A workload: trace requests in replay order plus what the replay needs to weigh them.

The replay, the bounds and the metrics all read the same `Workload`, so they agree
on what a block reference is: each request's block ids in order, a repeated id
within one request counted once (a block is computed once per request).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

from kvtier.sim.traces import (
    TraceFormatError,
    TraceRequest,
    read_bailian,
    read_mooncake,
    read_tokens,
)
from kvtier.types import BlockHash, int_block_hash

TraceFormat = Literal["mooncake", "bailian", "tokens"]
FORMATS: tuple[str, ...] = ("mooncake", "bailian", "tokens")

# Tokens per hash id in each format (tokens: the hashing block size of the reader).
_FORMAT_BLOCK_SIZE = {"mooncake": 512, "bailian": 16, "tokens": 16}


def format_block_size(fmt: str) -> int:
    """Tokens per hash id in a trace format (`FORMATS`)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    return _FORMAT_BLOCK_SIZE[fmt]


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival (stable), each with de-duplicated block ids."""

    name: str
    requests: tuple[TraceRequest, ...]
    block_size: int
    # True when an id stands for its whole prefix (Mooncake, token hashing, the
    # generator); False when ids name block contents only (Bailian).
    chained: bool
    block_ids: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        ordered = tuple(sorted(self.requests, key=lambda r: r.timestamp))
        object.__setattr__(self, "requests", ordered)
        ids = tuple(
            r.hash_ids if len(set(r.hash_ids)) == len(r.hash_ids) else _dedupe(r.hash_ids)
            for r in ordered
        )
        object.__setattr__(self, "block_ids", ids)

    @cached_property
    def block_refs(self) -> int:
        return sum(len(ids) for ids in self.block_ids)

    @cached_property
    def unique_blocks(self) -> int:
        seen: set[int] = set()
        for ids in self.block_ids:
            seen.update(ids)
        return len(seen)

    @cached_property
    def block_hashes(self) -> tuple[list[BlockHash], ...]:
        """Each request's ids packed as block hashes, once: every replay of it reuses them.

        An id is one object wherever it occurs, as the tiers' maps hold it: a lookup
        then matches by identity, with no bytes to compare, and a replay walks over
        a fraction of the memory (most references repeat an earlier id)."""
        unique = dict.fromkeys(itertools.chain.from_iterable(self.block_ids))
        packed = dict(zip(unique, map(int_block_hash, unique), strict=True))
        return tuple(list(map(packed.__getitem__, ids)) for ids in self.block_ids)

    @cached_property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    def block_tokens(self, index: int, position: int) -> int:
        """Tokens in block `position` of request `index` (the last block may be partial)."""
        remaining = self.requests[index].input_length - position * self.block_size
        return max(0, min(self.block_size, remaining))

    def limited(self, limit: int | None) -> Workload:
        """The first `limit` requests in replay order (all when None)."""
        if limit is None or limit >= len(self.requests):
            return self
        if limit <= 0:
            raise ValueError(f"limit must be > 0, got {limit}")
        return Workload(self.name, self.requests[:limit], self.block_size, self.chained)


def _dedupe(ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def load_workload(path: str | Path, fmt: str = "mooncake", *, limit: int | None = None) -> Workload:
    """Read a trace file in one of `FORMATS` as a replayable workload."""
    block_size = format_block_size(fmt)
    path = Path(path)
    if fmt == "mooncake":
        requests = read_mooncake(path, block_size)
    elif fmt == "bailian":
        requests = read_bailian(path, block_size)
    else:
        requests = read_tokens(path, block_size=block_size)
    workload = Workload(path.name, tuple(requests), block_size, fmt != "bailian")
    if not workload.block_refs:  # nothing to cache: every hit rate would be 0/0
        what = "no requests" if not requests else f"{len(requests)} requests but no blocks"
        raise TraceFormatError(
            f"{path}: the trace holds {what}; a replay needs at least one block "
            f"({block_size} tokens in {fmt} format)"
        )
    return workload.limited(limit)
