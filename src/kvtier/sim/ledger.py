"""The replay's one tally: per-tier counters and contents, fed by what happened.

The contract these figures keep is docs/semantics.md section 6.

Every mode of the replay writes here and nowhere else, so the figures mean the same
thing whichever tiers, clock or bytes plane ran:

- a tier's contents (for hits at any position) and its stores and evictions come
  from the tiers' own events, which they emit only for stores that completed
  successfully, so a failed store is not a store;
- a tier's hits ("served") are counted only for loads whose bytes reached the
  engine: a failed or corrupt load is a miss, served by no tier;
- faults the tiers cannot see themselves (a demotion that never reached the disk,
  a transfer that failed, a block found corrupt and forgotten) are reported here by
  the bytes plane, as errors and dropped blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from itertools import filterfalse

from kvtier.offload.abstract import OffloadingEvent
from kvtier.sim.metrics import TierCounters, TierStats
from kvtier.sim.workload import Workload
from kvtier.types import BlockHash


class Ledger:
    def __init__(self, workload: Workload, tiers: Sequence[TierCounters]) -> None:
        self.workload = workload
        self.tiers = {c.name: c for c in tiers}
        # What each offload tier holds, as its events say (the accelerator's own
        # prefix cache answers for itself).
        self.resident: dict[str, set[BlockHash]] = {c.name: set() for c in tiers}
        self.any_hits = 0
        self.prefill_tokens_saved = 0

    # --- what the tiers did ---------------------------------------------------------

    def events(self, events: Iterable[OffloadingEvent], *, faults: bool = False) -> None:
        """Stores and removals the tiers report; `faults`: removals of blocks found lost
        or corrupt (dropped), not evictions."""
        for event in events:
            name = event.medium.lower()
            tier, resident = self.tiers[name], self.resident[name]
            n = len(event.block_hashes)
            if event.removed:
                resident.difference_update(event.block_hashes)
                if faults:
                    tier.dropped_blocks += n
                else:
                    tier.evictions += n
            else:
                resident.update(event.block_hashes)
                tier.stores += n

    def preloaded(self, events: Iterable[OffloadingEvent]) -> int:
        """Blocks a tier held before the replay began (a reopened disk directory):
        present, but not stores of this run. Returns how many."""
        n = 0
        for event in events:
            if not event.removed:
                self.resident[event.medium.lower()].update(event.block_hashes)
                n += len(event.block_hashes)
        return n

    def store_failed(self, tier: str, num_blocks: int) -> None:
        """A store the tier had already reported (a demotion registered at once) failed."""
        self.tiers[tier].stores -= num_blocks
        self.tiers[tier].errors += 1

    def failed(self, tier: str) -> None:
        self.tiers[tier].errors += 1

    def rejected(self, tiers: Iterable[str]) -> None:
        for name in tiers:
            self.tiers[name].store_rejections += 1

    def filtered(self, tier: str, num_blocks: int) -> None:
        self.tiers[tier].filtered_stores += num_blocks

    def moved(self, tier: str, direction: str, num_bytes: int) -> None:
        """`direction`: "loaded" or "stored"."""
        if direction == "loaded":
            self.tiers[tier].bytes_loaded += num_bytes
        else:
            self.tiers[tier].bytes_stored += num_bytes

    def checksum_failed(self, tier: str, count: int = 1) -> None:
        self.tiers[tier].checksum_failures += count

    # --- what a request got ---------------------------------------------------------

    def absent(self, block_hashes: list[BlockHash]) -> list[BlockHash]:
        """Those of the hashes in no tier as far as the replay knows (a shared tier may have
        lost some), in order (the list given when all are); one C-level pass per tier:
        this runs for every block."""
        rest = block_hashes
        for resident in self.resident.values():
            if resident:
                rest = list(filterfalse(resident.__contains__, rest))
        return rest

    def served(self, request: int, tiers: Sequence[str], start: int = 0) -> None:
        """Blocks `start, start+1, ...` of `request` reached the engine from `tiers`,
        each weighed by its real tokens (a request's last block is usually partial)."""
        if not tiers:
            return
        if tiers.count(tiers[0]) == len(tiers):  # the usual case: all from one tier
            self.served_from(request, tiers[0], len(tiers), start)
            return
        position = start
        for name, run in itertools.groupby(tiers):
            n = len(list(run))
            self.served_from(request, name, n, position)
            position += n

    def served_from(self, request: int, tier: str, num_blocks: int, start: int = 0) -> None:
        """`served` of `num_blocks` blocks from one tier."""
        if not num_blocks:
            return
        bs = self.workload.block_size
        length = self.workload.requests[request].input_length
        counters = self.tiers[tier]
        counters.hit_blocks += num_blocks
        counters.hit_tokens += max(0, min((start + num_blocks) * bs, length) - start * bs)

    @property
    def prefix_hits(self) -> int:
        return sum(t.hit_blocks for t in self.tiers.values())

    @property
    def hit_tokens(self) -> int:
        return sum(t.hit_tokens for t in self.tiers.values())

    def freeze(self) -> tuple[TierStats, ...]:
        refs = self.workload.block_refs
        return tuple(t.freeze(refs) for t in self.tiers.values())
