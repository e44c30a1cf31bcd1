"""What the class ceilings' rules are worth when learned from the past, not in hindsight.

Why this exists: the class ceilings (`class_ceiling.py`) choose each class's hold time
knowing the trace's own reuse gaps. With every request-level signal (1,433 classes on
the public trace) and rules that change every tenth, they pass issue 35's targets; an
online policy must learn its rules from what it has seen. This replays that learning
as generously as it can be done, and reports block hits, to set beside the ceilings:

- the trace is cut in `segments` equal parts; each part after the first applies, per
  class, the hold times that are best (the upper hull of the class's curve, as the
  ceiling's) for every reference of the parts before it;
- generous where an online learner could not be: those earlier references' gaps are
  known whole (even where their next use is in a later part), the first part's rules
  are its own hindsight optimum, and the one price (hits per slot-request) that turns
  the hulls into hold times is chosen per part so that the part's references meet its
  share of the budget exactly (the capacity on average, as the ceiling's, mixing the
  two prices either side of it);
- a class never seen before holds nothing.

So it is not a bound: a learner could weigh the past better. It measures whether the
ceilings' margin over `reuse` is in the signals or in the hindsight: where the rules
learned from the past fall to what `reuse` reaches, a class set that looks far better
in hindsight is not, for a policy that has to learn it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from benchmarks.class_ceiling import hull_vertices, references
from benchmarks.hit_density import Classify

# the price search: hits per slot-request, from never holding to holding everything
PRICE_LOW, PRICE_HIGH, PRICE_STEPS = 1e-12, 1e3, 80


@dataclass(frozen=True)
class PartCurves:
    """One part's references of one class, to price any hold time: sorted gaps (to the
    next use) with their prefix sums, and sorted room (to the trace's end, for the
    references never used again) with theirs."""

    gaps: list[int]
    gap_sums: list[int]
    room: list[int]
    room_sums: list[int]

    @classmethod
    def of(cls, gaps: list[int], room: list[int]) -> PartCurves:
        gaps, room = sorted(gaps), sorted(room)
        return cls(gaps, [0, *itertools.accumulate(gaps)], room, [0, *itertools.accumulate(room)])

    def held(self, hold: int) -> tuple[int, int]:
        """(hits, slot-requests) of holding each reference `hold` requests."""
        i = bisect.bisect_right(self.gaps, hold)
        j = bisect.bisect_right(self.room, hold)
        cost = self.gap_sums[i] + (len(self.gaps) - i) * hold
        return i, cost + self.room_sums[j] + (len(self.room) - j) * hold


def past_rules_hits(
    block_ids: Sequence[Sequence[int]], capacity: int, classify: Classify, segments: int = 10
) -> float:
    """Block hits of per-class hold times learned from the parts before each (see the
    module). With one segment: the class ceiling itself, by prices."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    n = len(block_ids)
    if not 1 <= segments <= max(n, 1):
        raise ValueError(f"segments={segments}; from 1 to the trace's {n} requests")
    # per part, per class: the gaps, and the room to the trace's end of the others
    parts: list[dict[Hashable, tuple[list[int], list[int]]]] = [{} for _ in range(segments)]
    for t, c, gap in references(block_ids, classify):
        into = parts[t * segments // n].setdefault(c, ([], []))
        if gap is None:
            into[1].append(n - t)
        else:
            into[0].append(gap)
    hits = 0.0
    seen: dict[Hashable, tuple[list[int], list[int]]] = {}
    for k, part in enumerate(parts):
        # the first part's rules are its own hindsight's (with one part: the ceiling)
        known = seen if k else part
        hulls = {c: hull_vertices(sorted(g), sorted(r)) for c, (g, r) in known.items()}
        curves = {c: PartCurves.of(g, r) for c, (g, r) in part.items()}
        start, end = -(-k * n // segments), -(-(k + 1) * n // segments)
        hits += _priced(hulls, curves, capacity * (end - start))
        for c, (g, r) in part.items():
            into = seen.setdefault(c, ([], []))
            into[0].extend(g)
            into[1].extend(r)
    return hits


def _priced(
    hulls: dict[Hashable, list[tuple[float, int, int]]],
    curves: dict[Hashable, PartCurves],
    budget: int,
) -> float:
    """Hits of one part under the learned hulls, at the price that meets `budget`."""

    def at(price: float) -> tuple[int, int]:
        hits = cost = 0
        for c, curve in curves.items():
            hold, hull = 0, hulls.get(c, ())
            for a, b in itertools.pairwise(hull):
                if b[1] <= a[1] or (b[1] - a[1]) < price * (b[0] - a[0]):
                    break
                hold = b[2]
            h, s = curve.held(hold)
            hits, cost = hits + h, cost + s
        return hits, cost

    low, high = PRICE_LOW, PRICE_HIGH  # at `high` nothing is held: within any budget
    for _ in range(PRICE_STEPS):
        mid = math.sqrt(low * high)
        if at(mid)[1] > budget:
            low = mid
        else:
            high = mid
    (h_low, c_low), (h_high, c_high) = at(low), at(high)
    if c_low <= budget:  # everything worth holding fits
        return float(h_low)
    # between the two prices' rules, mixed to spend the budget exactly (the LP's optimum)
    return h_high + (h_low - h_high) * (budget - c_high) / (c_low - c_high)
