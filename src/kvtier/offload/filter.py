"""Admission by reuse: store a block only once it has been seen `store_threshold` times.

76% of the blocks of a real chat trace are referenced once only; storing them just
evicts blocks that would have been hit. vLLM counts sightings at `lookup`. With
`count_store_offers=True` the filter counts `prepare_store` offers instead: an
engine only looks up the hashes after its own prefix hit, and a request cut short
by a miss offers its whole tail for storing, so counting offers warms a block up
after `store_threshold` offers however the lookups fell. `store_threshold=1` is
accepted, as in vLLM: a block is stored once it has been looked up (or offered) once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import replace

from kvtier.offload.abstract import (
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    block_hash_list,
    reset_tier,
    unique_hashes,
)
from kvtier.offload.offloading_stats import OffloadingStats
from kvtier.types import BlockHash
from kvtier.validate import positive_int


class FilterReusedOffloadingManager(OffloadingManager):
    """Wraps any manager; only `lookup` and `prepare_store` are intercepted."""

    def __init__(
        self,
        backing: OffloadingManager,
        store_threshold: int = 2,
        max_tracker_size: int = 64_000,
        count_store_offers: bool = False,
    ) -> None:
        positive_int("store_threshold", store_threshold)
        positive_int("max_tracker_size", max_tracker_size)
        self._backing = backing
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.count_store_offers = count_store_offers
        # hash -> times seen, least recently seen first (dropped first when full)
        self.counts: OrderedDict[BlockHash, int] = OrderedDict()
        self._filtered_out = 0

    @property
    def backing(self) -> OffloadingManager:
        return self._backing

    def _count(self, hashes: list[BlockHash]) -> None:
        counts = self.counts
        for block_hash in hashes:
            seen = counts.get(block_hash)
            if seen is not None:
                counts.move_to_end(block_hash)
                counts[block_hash] = seen + 1
            else:
                if len(counts) >= self.max_tracker_size:
                    counts.popitem(last=False)
                counts[block_hash] = 1

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        """Count each listing (a hash listed twice counts twice, as in vLLM), then ask."""
        hashes = block_hash_list("lookup", block_hashes)
        if not self.count_store_offers:
            self._count(hashes)
        return self._backing.lookup(hashes)

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        # checked before counting: a rejected call changes nothing, whatever gets filtered;
        # a hash listed twice is one offer
        hashes = unique_hashes(block_hash_list("prepare_store", block_hashes))
        if self.count_store_offers:
            self._count(hashes)
        get, threshold = self.counts.get, self.store_threshold
        eligible = [h for h in hashes if get(h, 0) >= threshold]
        self._filtered_out += len(hashes) - len(eligible)
        return self._backing.prepare_store(eligible)

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        return self._backing.prepare_load(block_hashes)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        self._backing.touch(block_hashes)

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        self._backing.complete_load(block_hashes)

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        self._backing.complete_store(block_hashes, success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._backing.take_events()

    def reset_cache(self) -> list[BlockHash]:
        """Reset the backing manager; the sighting counts stay (they are about keys, and
        a block seen often before a weight update is as likely to be seen again)."""
        return reset_tier(self._backing)

    @property
    def counters(self) -> OffloadingStats:
        """The backing manager's counters (if it keeps any) plus hashes filtered out."""
        inner = getattr(self._backing, "counters", None)
        base = inner if isinstance(inner, OffloadingStats) else OffloadingStats()
        return replace(base, filtered_out=base.filtered_out + self._filtered_out)
