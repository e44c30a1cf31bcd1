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

import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, cast

from kvtier.offload.abstract import LoadStoreSpec, OffloadingEvent, OffloadingManager
from kvtier.offload.abstract import PrepareStoreOutput as KvtierStoreOutput
from kvtier.types import BlockHash

# Answers of some workers kept while others' are not in yet (bounded: vLLM may never
# ask again about a prefix; the oldest is forgotten first).
MAX_PARTIAL_ANSWERS = 4096


class EveryShardLookup(OffloadingManager):
    """`first`'s manager, with lookups that count only blocks `others` hold too."""

    def __init__(self, first: OffloadingManager, others: Sequence[OffloadingManager]) -> None:
        self.first = first
        self.others = list(others)
        self._managers = [first, *self.others]
        self._answers: OrderedDict[tuple[BlockHash, ...], list[int | None]] = OrderedDict()

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        """The shortest of the workers' prefixes; None while any answer is not in. An
        asynchronous answer is handed out once, so each one is kept until all are in
        (asking them all again each time could alternate forever between workers)."""
        hashes = list(block_hashes)
        key = tuple(hashes)
        answers = self._answers.pop(key, None) or [None] * len(self._managers)
        for i, manager in enumerate(self._managers):
            if answers[i] is None:
                answers[i] = manager.lookup(hashes)
        if any(a is None for a in answers):
            self._answers[key] = answers
            if len(self._answers) > MAX_PARTIAL_ANSWERS:
                self._answers.popitem(last=False)
            return None
        return min(a for a in answers if a is not None)

    @contextmanager
    def held_lookups(self) -> Iterator[None]:
        """Every worker's lookups asked inside go out together when it ends."""
        with ExitStack() as stack:
            for manager in self._managers:
                hold = getattr(manager, "held_lookups", None)
                if hold is not None:
                    stack.enter_context(hold())
            yield

    def wait_lookups(self, timeout: float | None = None) -> bool:
        """Block (up to `timeout` in all) until every worker's asynchronous lookups have
        answers."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for manager in self._managers:
            wait = getattr(manager, "wait_lookups", None)
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if wait is not None and not wait(left):
                return False
        return True

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

    # --- what the reset and the metrics ask of the Redis tier's manager -------------

    def reset_cache(self, salt: str | None = None) -> list[BlockHash]:
        """Every worker's keys move to the epoch `salt` (see `RemoteOffloadingManager`)."""
        self._answers.clear()
        for manager in self._managers:
            cast(Any, manager).reset_cache(salt)
        return []

    @property
    def store(self) -> Any:
        """The first worker's store: its breaker and counters stand for the tier's."""
        return cast(Any, self.first).store

    def lookup_in_flight(self) -> tuple[int, float] | None:
        """The oldest of the workers' round trips on their way, and its seconds so far
        (`RemoteOffloadingManager.lookup_in_flight`): a request waits for every
        worker's answer, so each one's trip ahead of its questions is a floor on its
        wait. Numbered apart per worker (a trip's number times the workers, plus the
        worker's index), so that another worker's trip is never taken for it."""
        oldest: tuple[int, float] | None = None
        count = len(self._managers)
        for index, manager in enumerate(self._managers):
            in_flight = getattr(manager, "lookup_in_flight", None)
            trip = None if in_flight is None else in_flight()
            if trip is not None and (oldest is None or trip[1] > oldest[1]):
                oldest = (trip[0] * count + index, trip[1])
        return oldest

    def take_lookup_seconds(self) -> list[float]:
        seconds: list[float] = cast(Any, self.first).take_lookup_seconds()
        return seconds
