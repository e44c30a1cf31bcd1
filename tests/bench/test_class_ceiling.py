"""The class ceiling (benchmarks/class_ceiling.py): at least every choice of hold times per
class that fits the budget (brute force on small traces), at most every reuse, all of
them with room for every block, and never lower for finer classes."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import pytest
from benchmarks.class_ceiling import SignalClasses, UseClasses, class_ceiling
from benchmarks.hit_density import NextUseClasses, OnlineClasses
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sim import GeneratorConfig, generate_workload
from kvtier.sim.bounds import infinite_hits
from tests.sim.test_prefix_bound import Requests, chained_requests


def parity(t: int, ids: Sequence[int]) -> list[Hashable]:
    return [b % 2 for b in ids]


def one_class(t: int, ids: Sequence[int]) -> list[Hashable]:
    return [0] * len(ids)


def per_block(t: int, ids: Sequence[int]) -> list[Hashable]:
    return list(ids)


def choices(requests: Requests) -> list[tuple[int, int]]:
    """(slot-requests, hits) of every hold time per parity class, 0 to the trace's
    length: each reference held T requests after it (to the trace's end at most)."""
    n = len(requests)
    refs: list[tuple[int, int | None, int]] = []  # (class, gap or None, room to the end)
    last: dict[int, int] = {}
    for t, ids in enumerate(requests):
        for b in ids:
            if b in last:
                refs.append((b % 2, t - last[b], 0))
            last[b] = t
    refs += [(b % 2, None, n - t) for b, t in last.items()]
    out = []
    for holds in itertools.product(range(n + 1), repeat=2):
        hits = sum(1 for c, gap, _ in refs if gap is not None and gap <= holds[c])
        cost = sum(min(gap if gap is not None else room, holds[c]) for c, gap, room in refs)
        out.append((cost, hits))
    return out


def best_mix(points: list[tuple[int, int]], budget: int) -> float:
    """The linear program's optimum by brute force: with one budget, an optimal mix
    needs at most two choices."""
    best = float(max(h for c, h in points if c <= budget))
    for (c1, h1), (c2, h2) in itertools.product(points, repeat=2):
        if c1 <= budget < c2:
            best = max(best, h1 + (h2 - h1) * (budget - c1) / (c2 - c1))
    return best


@settings(max_examples=200, deadline=None)
@given(chained_requests(), st.integers(0, 6))
def test_the_best_mix_of_hold_times_per_class_that_fits(requests: Requests, capacity: int) -> None:
    ceiling = class_ceiling(requests, capacity, parity)
    points = choices(requests)
    assert ceiling.hits == pytest.approx(best_mix(points, capacity * len(requests)))
    assert ceiling.hits >= max(h for c, h in points if c <= ceiling.budget)  # any one choice
    assert ceiling.hits <= infinite_hits(requests)[0] + 1e-9
    assert ceiling.budget == capacity * len(requests)


@settings(max_examples=100, deadline=None)
@given(chained_requests(), st.integers(0, 6))
def test_finer_classes_never_lower_it(requests: Requests, capacity: int) -> None:
    coarse = class_ceiling(requests, capacity, one_class).hits
    assert class_ceiling(requests, capacity, parity).hits >= coarse - 1e-9
    assert class_ceiling(requests, capacity, per_block).hits >= coarse - 1e-9


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000))
def test_room_for_every_block_hits_every_reuse(seed: int) -> None:
    workload = generate_workload(GeneratorConfig(num_requests=300), seed=seed)
    ids = [list(r) for r in workload.block_ids]
    everything = infinite_hits(ids)[0]
    classifiers = (one_class, UseClasses(), OnlineClasses(), SignalClasses(), NextUseClasses(ids))
    for classify in classifiers:
        assert class_ceiling(ids, workload.unique_blocks, classify).hits == pytest.approx(
            everything
        )


def test_one_class_holds_what_fits() -> None:
    """Two blocks used every other request: held 2 requests after each use, the four
    reuses cost 8 slot-requests and the last uses 3 more (to the trace's end); one slot
    over 6 requests buys 6/11 of that mix."""
    requests = [[1], [2], [1], [2], [1], [2]]
    assert class_ceiling(requests, 1, one_class).hits == pytest.approx(4 * 6 / 11)
    assert class_ceiling(requests, 0, one_class).hits == 0
    assert class_ceiling(requests, 2, one_class).hits == pytest.approx(4)


def test_the_use_classes_tell_a_requests_new_last_block_apart() -> None:
    uses = UseClasses()
    assert uses(0, [1, 2, 3]) == [1, 1, "last"]
    assert uses(1, [1, 2, 4]) == [2, 2, "last"]
    assert uses(2, [1, 2, 4, 5, 6]) == [3, 3, 2, 1, "last"]
    assert uses(3, [1, 2]) == [4, 4]
    assert uses(4, []) == []


def test_knowing_when_lifts_it_and_bad_input_is_refused() -> None:
    workload = generate_workload(GeneratorConfig(num_requests=400), seed=3)
    ids = [list(r) for r in workload.block_ids]
    capacity = workload.unique_blocks // 50
    online = class_ceiling(ids, capacity, OnlineClasses()).hits
    assert class_ceiling(ids, capacity, NextUseClasses(ids)).hits > online
    with pytest.raises(ValueError, match="capacity must be >= 0, got -1"):
        class_ceiling(ids, -1, one_class)
    with pytest.raises(ValueError, match="request 0: 0 classes for 1 blocks"):
        class_ceiling([[1]], 1, lambda t, ids: [])
    with pytest.raises(ValueError, match="segments=10, num_requests=0"):
        SignalClasses(segments=10)
