"""Reference bounds: what no policy can beat on the same block-reference stream.

- Infinite cache: a block hits when any earlier request referenced it (only cold
  misses remain). The ceiling for any capacity.
- Belady MIN with bypass: at a fixed capacity, the offline optimum for the number
  of hits with demand fetching. On a miss the incoming block is admitted only if it
  is needed again sooner than the block it would replace; a block never needed
  again is never kept. `brute_force_hits` searches every admission/eviction choice
  on tiny traces and is what the tests hold Belady to.
- Prefix-aware: the most *prefix* hits (the run from a request's first block, what
  an engine can use) any policy of the same capacity can reach. At least the hits
  of prefix MIN, an offline schedule (`kvtier.sim.prefix_bound`), at most Belady's;
  on chained traces the two are equal, so the bound is exact there.

The stream is each request's block ids in order, requests in arrival order (the
published figures for the Mooncake trace are computed the same way).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.sim.prefix_bound import exhaustive_prefix_hits, prefix_min_hits
from kvtier.sim.workload import Workload


@dataclass(frozen=True)
class Bounds:
    block_refs: int
    infinite_hits: int
    infinite_prefix_hits: int
    capacity: int
    belady_hits: int
    # prefix hits of prefix MIN: the prefix-aware optimum is in [this, belady_hits]
    prefix_min_hits: int = 0
    # What the bounds take for granted that the replayed tiers may not honour (a
    # shared tier counted as unbounded, or pre-filled by earlier runs).
    assumptions: tuple[str, ...] = ()

    @property
    def infinite(self) -> float:
        return self.infinite_hits / self.block_refs if self.block_refs else 0.0

    @property
    def infinite_prefix(self) -> float:
        return self.infinite_prefix_hits / self.block_refs if self.block_refs else 0.0

    @property
    def belady(self) -> float:
        return self.belady_hits / self.block_refs if self.block_refs else 0.0

    @property
    def prefix_min(self) -> float:
        """The prefix-aware bound's lower end: prefix MIN's prefix hit rate."""
        return self.prefix_min_hits / self.block_refs if self.block_refs else 0.0

    @property
    def prefix_exact(self) -> bool:
        """Whether prefix MIN reaches Belady: then both are the optimum prefix hit rate."""
        return self.prefix_min_hits == self.belady_hits


def flatten(workload: Workload) -> list[int]:
    return [b for ids in workload.block_ids for b in ids]


def infinite_hits(requests: Iterable[Sequence[int]]) -> tuple[int, int]:
    """(any-position hits, prefix-consecutive hits) of a cache that never evicts."""
    seen: set[int] = set()
    hits = prefix_hits = 0
    for ids in requests:
        run = 0
        while run < len(ids) and ids[run] in seen:
            run += 1
        prefix_hits += run
        hits += run + sum(1 for b in ids[run:] if b in seen)
        seen.update(ids)
    return hits, prefix_hits


def next_uses(refs: Sequence[int]) -> list[int]:
    """For each position, the position of the next reference to the same block (or len)."""
    never = len(refs)
    following: dict[int, int] = {}
    result = [never] * never
    for i in range(never - 1, -1, -1):
        b = refs[i]
        result[i] = following.get(b, never)
        following[b] = i
    return result


def belady_hits(refs: Sequence[int], capacity: int) -> int:
    """Hits of Belady's MIN with bypass at `capacity` blocks (O(n log n))."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if capacity == 0:
        return 0
    never = len(refs)
    nxt = next_uses(refs)
    cached: dict[int, int] = {}  # block -> position of its next reference
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped lazily
    hits = 0
    for i, b in enumerate(refs):
        nu = nxt[i]
        if b in cached:
            hits += 1
            if nu == never:
                del cached[b]
            else:
                cached[b] = nu
                heapq.heappush(heap, (-nu, b))
            continue
        if nu == never:
            continue
        if len(cached) >= capacity:
            while cached.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] <= nu:
                continue  # bypass: every cached block is needed sooner
            del cached[heapq.heappop(heap)[1]]
        cached[b] = nu
        heapq.heappush(heap, (-nu, b))
    return hits


def brute_force_hits(refs: Sequence[int], capacity: int) -> int:
    """The true optimum by exhaustive search over cache contents (tiny traces only): the
    prefix-aware search over requests of one block each, whose hits are block hits."""
    if len(refs) > 24:
        raise ValueError(f"brute force is exponential; got {len(refs)} references (max 24)")
    return exhaustive_prefix_hits([[b] for b in refs], capacity)


def compute_bounds(workload: Workload, capacity: int, assumptions: tuple[str, ...] = ()) -> Bounds:
    """Every bound starts from empty tiers, at `capacity` blocks in all."""
    hits, prefix_hits = infinite_hits(workload.block_ids)
    return Bounds(
        block_refs=workload.block_refs,
        infinite_hits=hits,
        infinite_prefix_hits=prefix_hits,
        capacity=capacity,
        belady_hits=belady_hits(flatten(workload), capacity),
        prefix_min_hits=prefix_min_hits(workload.block_ids, capacity),
        assumptions=assumptions,
    )
