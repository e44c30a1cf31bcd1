"""The most any policy that tells blocks apart only by a class can hit: a ceiling.

Why this exists: issue 35 asks an online policy for 0.1493 of the public trace's block
references at 1% and 0.2810 at 5%; `reuse` reaches 0.1075 and 0.2253, and nothing tried
(bonuses, hit density on online classes: `hit_density.py`) passed it at both. This puts a
number on what the signals allow, whatever the mechanism.

A policy that knows of a stored block only its class (whatever it read when the block
was last used: uses so far, the conversation's turn, the gap since its previous use...)
and its age decides, per class, how long to hold a block after a use: dropping it and
taking it back before its next use gains nothing, so its choice is a hold time per
class, or a mix of hold times. Held for T requests, a reference whose block is next used
g requests later is a hit if g <= T and costs min(g, T) slot-requests (one never used
again costs T, up to the trace's end). With the tier's capacity met on average over the
trace instead of at every request (capacity x requests slot-requests in all), the best
mix is a linear program: maximise the hits of the classes' (cost, hits) curves within
the budget, which is a fractional knapsack over each curve's upper concave hull.

Every relaxation only raises the figure: the capacity is met on average, a block hit
counts without its prefix, and each class's gaps are known in hindsight (the best hold
times for the trace itself). So no policy applying fixed rules to those classes beats
it; one that reads more than its classes, or changes its rules as the trace goes, may
(on a generated trace at 1%, `reuse`, whose duel changes its rules, passed the ceiling
of its own signals by 0.0007). Classes that include the trace's tenth (`SignalClasses`'s
`segments`) let the rules change ten times over the trace, in hindsight too.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from benchmarks.hit_density import Classify, conversation_turn


@dataclass(frozen=True)
class Ceiling:
    hits: float  # block hits of the best mix of hold times per class (the LP's optimum)
    classes: int  # classes the references fell in
    budget: int  # capacity x requests: the slot-requests held on average


def class_ceiling(block_ids: Sequence[Sequence[int]], capacity: int, classify: Classify) -> Ceiling:
    """The ceiling (see the module) of policies that read `classify`'s classes, called
    once per request in order (online classifiers keep state)."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    n = len(block_ids)
    # per class: the gap to each reference's next use, and each last reference's room to
    # the trace's end (held that long at most)
    gaps: dict[Hashable, list[int]] = {}
    room: dict[Hashable, list[int]] = {}
    for t, c, gap in references(block_ids, classify):
        if gap is None:
            room.setdefault(c, []).append(n - t)
        else:
            gaps.setdefault(c, []).append(gap)
    budget = capacity * n
    segments = []
    for c in gaps.keys() | room.keys():
        segments += _hull_segments(sorted(gaps.get(c, ())), sorted(room.get(c, ())))
    segments.sort(key=lambda s: s[1] * 1.0 / s[0] if s[0] else math.inf, reverse=True)
    hits, left = 0.0, float(budget)
    for cost, gained in segments:
        if cost <= left:
            hits, left = hits + gained, left - cost
        else:
            hits += gained * left / cost
            break
    return Ceiling(hits=hits, classes=len(gaps.keys() | room.keys()), budget=budget)


def references(
    block_ids: Sequence[Sequence[int]], classify: Classify
) -> list[tuple[int, Hashable, int | None]]:
    """Every block reference, in order: its request, its class (`classify` is called once
    per request in order: online classifiers keep state) and the requests to its
    block's next use (None: never used again)."""
    refs: list[tuple[int, Hashable, int | None]] = []
    last: dict[int, int] = {}
    for t, ids in enumerate(block_ids):
        classes = classify(t, ids)
        if len(classes) != len(ids):
            raise ValueError(f"request {t}: {len(classes)} classes for {len(ids)} blocks")
        for b, c in zip(ids, classes, strict=True):
            before = last.get(b)
            if before is not None:
                was, cls, _ = refs[before]
                refs[before] = (was, cls, t - was)
            last[b] = len(refs)
            refs.append((t, c, None))
    return refs


def _hull_segments(gaps: list[int], room: list[int]) -> list[tuple[float, int]]:
    """The (cost, hits) steps along the upper concave hull of one class's curve, from
    holding nothing (0, 0) to holding every block until its next use."""
    hull = hull_vertices(gaps, room)
    return [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(hull) if b[1] > a[1]]


def hull_vertices(gaps: list[int], room: list[int]) -> list[tuple[float, int, int]]:
    """The (cost, hits, hold time) vertices of the upper concave hull of one class's
    curve (`gaps` and `room` sorted), from holding nothing: a hold time T worth trying
    is a gap (the hits rise only there)."""
    points = [(0.0, 0, 0)]
    i, below_cost = 0, 0.0  # gaps <= T so far, and their summed gaps
    r, room_below = 0, 0.0  # room values <= T so far, and their sum
    for T in sorted(set(gaps)):
        while i < len(gaps) and gaps[i] <= T:
            below_cost += gaps[i]
            i += 1
        while r < len(room) and room[r] <= T:
            room_below += room[r]
            r += 1
        cost = below_cost + (len(gaps) - i) * T + room_below + (len(room) - r) * T
        points.append((cost, i, T))
    hull: list[tuple[float, int, int]] = []
    for p in points:  # monotone chain: costs rise, keep the upper hull
        while len(hull) >= 2 and _cross(hull[-2][:2], hull[-1][:2], p[:2]) >= 0:
            hull.pop()
        hull.append(p)
    return hull


def _cross(o: tuple[float, int], a: tuple[float, int], b: tuple[float, int]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


class UseClasses:
    """Online: the signals `reuse` reads, uses so far (capped at 4) and whether it is a
    request's last block seen for the first time (5 classes)."""

    def __init__(self) -> None:
        self._uses: dict[int, int] = {}

    def __call__(self, t: int, ids: Sequence[int]) -> list[Hashable]:
        uses = self._uses
        classes: list[Hashable] = []
        for b in ids:
            used = uses[b] = uses.get(b, 0) + 1
            classes.append(min(used, 4))
        if ids and uses[ids[-1]] == 1:
            classes[-1] = "last"
        return classes


class SignalClasses:
    """Online: every request-level signal `bench_prefix_gap.signals` reads, together:
    uses so far (capped at 8), whether it is a request's last block seen for the first
    time, the requests since its previous use (by half powers of two), its
    conversation's turn (capped at 5, as `OnlineClasses` counts it), the request's size
    (blocks, by fours, capped at 32), and with `segments` > 1 which of that many equal
    parts of the trace the request is in (`num_requests` long). Thousands of classes:
    more than an online policy could learn from, which only raises the ceiling."""

    def __init__(self, segments: int = 1, num_requests: int = 0) -> None:
        if segments < 1 or (segments > 1 and num_requests < 1):
            raise ValueError(
                f"segments={segments}, num_requests={num_requests}: segments >= 1, and "
                "num_requests >= 1 where segments > 1"
            )
        self.segments = segments
        self.num_requests = num_requests
        self._uses: dict[int, int] = {}
        self._turn: dict[int, int] = {}
        self._last_use: dict[int, int] = {}

    def __call__(self, t: int, ids: Sequence[int]) -> list[Hashable]:
        uses, turns, last_use = self._uses, self._turn, self._last_use
        turn = conversation_turn(ids, turns)
        part = t * self.segments // self.num_requests if self.segments > 1 else 0
        size = min(len(ids) // 4, 8)
        classes: list[Hashable] = []
        for j, b in enumerate(ids):
            used = uses.get(b, 0) + 1
            before = last_use.get(b)
            gap = -1 if before is None else int(2 * math.log2(t - before + 1))
            first_last = used == 1 and j == len(ids) - 1
            classes.append((min(used, 8), first_last, gap, min(turn, 5), size, part))
            uses[b], turns[b], last_use[b] = used, turn, t
        return classes
