"""The prefix-aware bound: the most prefix hits any policy of a given capacity can reach.

Belady's MIN counts a block hit at any position, but an engine can use a hit only
as part of the run of hits from a request's first block. The model here is the
replay's with no accelerator tier (docs/semantics.md section 6): between two
requests the tier holds at most `capacity` blocks, each either held before or
part of the request just served, and a request's prefix hits are its leading
blocks found there. Every policy the replay runs is such a schedule, online or not.

`prefix_min_hits` is an offline schedule of that model, a lower bound on the
optimum by construction: Belady's MIN over *intervals* (a block kept from one
request to its next use), where a request's kept intervals must form a prefix. When
more is kept than fits, it drops the interval of the request used farthest in the
future, the deepest one of that request (the only drop that keeps its other
intervals useful). Belady's MIN with bypass (`kvtier.sim.bounds.belady_hits`) is a
proven upper bound: a schedule's prefix hits are hits of a per-block schedule that
admits its new blocks after the hits (the proof is in the docs). So the optimum lies
in [prefix MIN, Belady], and where the two meet it is known exactly.

On chained traces (an id stands for its whole prefix: Mooncake, token hashing, the
generator) they always meet: a block's previous use is never earlier than its
child's (a request that holds the child holds the parent), so the parent's interval
lies inside the child's and ends at the same request, and MIN never needs to keep a
child without its parent. The tests hold this to a brute-force optimum on small
traces; on traces whose ids name contents only (Bailian) the two can differ and
both are reported (`kvtier.sim.bounds.compute_bounds` gives prefix MIN beside Belady).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence


def _intervals(requests: Sequence[Sequence[int]]) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """(usable[u], starts[p]): a request u can hit at most its first `usable[u]` blocks
    (up to its first block never seen before); starts[p] lists the (u, position) of
    the blocks whose previous use before u is request p."""
    last: dict[int, int] = {}
    usable = [0] * len(requests)
    starts: list[list[tuple[int, int]]] = [[] for _ in requests]
    for u, ids in enumerate(requests):
        k = 0
        for j, block in enumerate(ids):
            p = last.get(block)
            if p is None:
                break
            starts[p].append((u, j))
            k += 1
        usable[u] = k
        for block in ids:
            last[block] = u
    return usable, starts


def prefix_min_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """Prefix hits of prefix MIN, an offline schedule (see the module docstring)."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if capacity == 0:
        return 0
    usable, starts = _intervals(requests)
    end = usable[:]  # request u may hit its first end[u] blocks (only ever lowered)
    kept: list[list[int]] = [[] for _ in requests]  # u's kept positions, sorted, all < end[u]
    held = 0  # kept intervals in all: blocks in the tier
    farthest: list[int] = []  # -u for every u that may hold kept intervals
    hits = 0
    for s in range(len(requests)):
        # request s arrives: its kept intervals are hits, and end here
        hits += end[s]
        held -= len(kept[s])
        kept[s] = []
        # its blocks' next uses start intervals now
        for u, j in starts[s]:
            if j < end[u]:
                bisect.insort(kept[u], j)
                held += 1
                heapq.heappush(farthest, -u)
        # over capacity: the request used farthest ahead gives up its deepest block
        while held > capacity:
            u = -farthest[0]
            if not kept[u]:
                heapq.heappop(farthest)
                continue
            end[u] = kept[u].pop()
            held -= 1
    return hits


def brute_force_prefix_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """The true optimum of the model by exhaustive search over tier contents (tiny only)."""
    blocks = {b for ids in requests for b in ids}
    if len(blocks) > 10:
        raise ValueError(f"brute force is exponential; got {len(blocks)} distinct blocks (max 10)")
    return exhaustive_prefix_hits(requests, capacity)


def exhaustive_prefix_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """The optimum by trying every tier content after every request: exponential in the
    distinct blocks, unchecked (`brute_force_prefix_hits` and Belady's `brute_force_hits`,
    whose one-block requests make it the per-block optimum, bound the size)."""
    from itertools import combinations

    best: dict[frozenset[int], int] = {frozenset(): 0}
    for ids in requests:
        step: dict[frozenset[int], int] = {}
        for held, hits in best.items():
            run = 0
            while run < len(ids) and ids[run] in held:
                run += 1
            pool = sorted(held | set(ids))
            for k in range(min(capacity, len(pool)) + 1):
                for keep in combinations(pool, k):
                    key = frozenset(keep)
                    if step.get(key, -1) < hits + run:
                        step[key] = hits + run
        best = step
    return max(best.values())
