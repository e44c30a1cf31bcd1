"""Hit-density eviction by class of block: how far knowing *when* a block returns goes.

Why this exists: on the public trace an online policy must reach 0.1493 at 1% and
0.2810 at 5% (issue 35), `reuse` reaches 0.1075 and 0.2253, and an admission oracle
(told *which* blocks return, not when) reaches only 0.1172 at 1%. This module asks
the next question with one eviction mechanism and two sources of knowledge:

- `NextUseClasses`: each block's class is the order of magnitude (a power of two, in
  requests) of the time to its next use: offline knowledge of *when*, to a factor of 2;
- `OnlineClasses`: what a policy can read when it stores or touches a block: its
  uses so far, its conversation's turn, whether it is a request's last new block.

The mechanism is LHD's (Beckmann, Chen and Cidon, NSDI'18), by class: each class
learns from every block's observed reuse gaps the distribution of the time to its
next use, and eviction takes, among the least recently used block of each class,
the one with the fewest expected hits per slot and per request held, given its age.
If it reaches the targets with the first classes and not with the second, what is
missing is the signal, not the mechanism. The replay is the prefix model of
`kvtier.sim.prefix_bound` (docs/semantics.md section 6): a request's hits are its
leading blocks held when it arrives, then its blocks are held (its head first when
more than the capacity).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence

BIN = 8  # requests per age bin
BINS = 128  # ages learned: 1,024 requests (a longer gap counts as no return)
HORIZON = 8.0  # a block is assumed held at most this many mean eviction ages
REFRESH = 128  # requests between two computations of the density tables
DECAY = 0.9  # per refresh: the histograms weigh the last ~10 refreshes most
NEVER_CLASS = 15  # NextUseClasses' class of a block with no later use

# (request index, the request's ids) -> one class per id
Classify = Callable[[int, Sequence[int]], list[Hashable]]


class NextUseClasses:
    """Offline: a block's class is the bit length of the requests until its next use."""

    def __init__(self, block_ids: Sequence[Sequence[int]]) -> None:
        following: dict[int, int] = {}
        self._classes: list[list[Hashable]] = [[] for _ in block_ids]
        for t in range(len(block_ids) - 1, -1, -1):
            ids = block_ids[t]
            self._classes[t] = [
                min((following[b] - t).bit_length(), NEVER_CLASS - 1)
                if b in following
                else NEVER_CLASS
                for b in ids
            ]
            following.update(zip(ids, itertools.repeat(t)))

    def __call__(self, t: int, ids: Sequence[int]) -> list[Hashable]:
        return self._classes[t]


def conversation_turn(ids: Sequence[int], turns: Mapping[int, int]) -> int:
    """A request's conversation turn: one more than the turn of the deepest block of its
    already-seen prefix (`turns`: each block's turn when last used), if that prefix is
    longer than one block (a shared first block is no conversation); else 1."""
    seen = 0
    while seen < len(ids) and ids[seen] in turns:
        seen += 1
    return turns[ids[seen - 1]] + 1 if seen >= 2 else 1


class OnlineClasses:
    """Online: (uses so far, capped at 4; conversation turn, capped at 4), or "last" for a
    request's last block seen for the first time. The turn is one more than the turn of
    the deepest block of the request's already-seen prefix, if that prefix is longer than
    one block (a shared first block is no conversation). The history is unbounded, which
    only flatters this side."""

    def __init__(self) -> None:
        self._uses: dict[int, int] = {}
        self._turn: dict[int, int] = {}

    def __call__(self, t: int, ids: Sequence[int]) -> list[Hashable]:
        uses, turns = self._uses, self._turn
        turn = conversation_turn(ids, turns)
        classes: list[Hashable] = []
        for b in ids:
            used = uses.get(b, 0) + 1
            uses[b] = used
            turns[b] = turn
            classes.append((min(used, 4), min(turn, 4)))
        if uses[ids[-1]] == 1:
            classes[-1] = "last"
        return classes


class _Densities:
    """Per class: a decayed histogram of reuse gaps (in bins) and the density table."""

    def __init__(self) -> None:
        self.gaps: dict[Hashable, list[float]] = {}  # class -> BINS bins + "no return"
        self.tables: dict[Hashable, list[float]] = {}

    def record(self, c: Hashable, gap_bin: int) -> None:
        gaps = self.gaps.get(c)
        if gaps is None:
            gaps = self.gaps[c] = [0.0] * (BINS + 1)
        gaps[min(gap_bin, BINS)] += 1.0

    def density(self, c: Hashable, age: int) -> float:
        table = self.tables.get(c)
        return float("inf") if table is None else table[min(age // BIN, BINS - 1)]

    def recompute(self, horizon_bins: float) -> None:
        """density(a) = returns within the horizon after age a / expected slot time held
        (until the return or the horizon), over blocks still unreturned at age a."""
        w = max(1, round(horizon_bins))
        for c, gaps in self.gaps.items():
            counts = [0.0, *itertools.accumulate(gaps[:BINS])]  # counts[g]: gaps < g
            weighted = [0.0, *itertools.accumulate(g * n for g, n in enumerate(gaps[:BINS]))]
            table = []
            for a in range(BINS):
                z = min(a + w, BINS)
                within = counts[z] - counts[a]
                held = weighted[z] - weighted[a] - (a - 0.5) * within
                later = counts[BINS] - counts[z] + gaps[BINS]
                total = held + later * w
                table.append(within / total if total > 0 else 0.0)
            self.tables[c] = table
            self.gaps[c] = [n * DECAY for n in gaps]


def density_hits(block_ids: Sequence[Sequence[int]], capacity: int, classify: Classify) -> int:
    """Prefix hits of hit-density eviction with `classify`'s classes (see the module)."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    lists: dict[Hashable, OrderedDict[int, int]] = {}  # class -> id -> last use, LRU first
    class_of: dict[int, Hashable] = {}
    last_seen: OrderedDict[int, tuple[Hashable, int]] = OrderedDict()  # every id, BINS*BIN
    densities = _Densities()
    eviction_age = float(BIN)  # a moving mean, in requests
    hits = 0
    for t, ids in enumerate(block_ids):
        if not ids:
            continue
        run = 0
        while run < len(ids) and ids[run] in class_of:
            run += 1
        hits += run
        classes = classify(t, ids)
        # learn: a gap per id seen within the window; the window's older ids never returned
        for b, c in zip(ids, classes, strict=True):
            before = last_seen.pop(b, None)
            if before is not None:
                densities.record(before[0], (t - before[1]) // BIN)
            last_seen[b] = (c, t)
        while last_seen:
            b, (c, t0) = next(iter(last_seen.items()))
            if t - t0 < BINS * BIN:
                break
            del last_seen[b]
            densities.record(c, BINS)
        # the request's blocks leave their lists, then room is made among the others
        kept = ids[:capacity]
        for b in kept:
            c = class_of.pop(b, None)
            if c is not None:
                del lists[c][b]
        for b in ids[capacity:]:  # a request larger than the tier keeps its head
            c = class_of.pop(b, None)
            if c is not None:
                del lists[c][b]
        for _ in range(len(class_of) + len(kept) - capacity):
            victim, age = _evict(lists, densities, t)
            del class_of[victim]
            eviction_age += (age - eviction_age) / 1024
        # deepest first: a parent is more recent than its children in any class
        for b, c in zip(reversed(kept), reversed(classes[: len(kept)]), strict=True):
            lists.setdefault(c, OrderedDict())[b] = t
            class_of[b] = c
        if t % REFRESH == 0:
            densities.recompute(HORIZON * eviction_age / BIN)
    return hits


def _evict(
    lists: dict[Hashable, OrderedDict[int, int]], densities: _Densities, t: int
) -> tuple[int, int]:
    """Remove and return (id, age) of the lowest-density head among the classes' LRU ends."""
    best: OrderedDict[int, int] | None = None
    best_density = 0.0
    for c, order in lists.items():
        if order:
            density = densities.density(c, t - next(iter(order.values())))
            if best is None or density < best_density:
                best, best_density = order, density
    if best is None:  # pragma: no cover - the caller evicts only what is held
        raise RuntimeError("nothing to evict")
    victim, used = best.popitem(last=False)
    return victim, t - used
