"""The Redis tier as the scheduler side of a tensor-parallel engine sees it.

Each worker stores its own shard of a block under its own keys, and a block is in
Redis only when every worker's shard is: one worker's store may fail (a timeout), or
Redis may evict one shard and not the other. A lookup that asked only for the first
worker's shard would then offer a block whose load fails on another worker, every
time it is asked for (the load fails, vLLM recomputes, and the next request tries
again). So lookups ask every worker's keys and answer the shortest prefix; stores,
loads and events are the first worker's manager's (the slots are the same for all).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.offload.abstract import LoadStoreSpec, OffloadingEvent, OffloadingManager
from kvtier.offload.abstract import PrepareStoreOutput as KvtierStoreOutput
from kvtier.types import BlockHash


class EveryShardLookup(OffloadingManager):
    """`first`'s manager, with lookups that count only blocks `others` hold too."""

    def __init__(self, first: OffloadingManager, others: Sequence[OffloadingManager]) -> None:
        self.first = first
        self.others = list(others)

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        hashes = list(block_hashes)
        found = self.first.lookup(hashes)
        for other in self.others:  # each asked, so asynchronous lookups all start
            theirs = other.lookup(hashes)
            found = None if found is None or theirs is None else min(found, theirs)
        return found

    def wait_lookups(self, timeout: float | None = None) -> bool:
        """Block until every worker's asynchronous lookups have answers (tests, tools)."""
        managers = [self.first, *self.others]
        return all(getattr(m, "wait_lookups", lambda _t: True)(timeout) for m in managers)

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        return self.first.prepare_load(block_hashes)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        self.first.touch(block_hashes)

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        self.first.complete_load(block_hashes)

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> KvtierStoreOutput | None:
        return self.first.prepare_store(block_hashes)

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        self.first.complete_store(block_hashes, success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.first.take_events()
