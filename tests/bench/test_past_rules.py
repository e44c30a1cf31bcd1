"""Rules learned from the past (benchmarks/past_rules.py): with one part the class ceiling
itself, never above the ceiling of rules that may change part by part in hindsight,
nothing held for a class never seen, and the hold times of the parts before applied
as they are (worked by hand)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path

import pytest
from benchmarks.class_ceiling import SignalClasses, UseClasses, class_ceiling
from benchmarks.hit_density import OnlineClasses
from benchmarks.past_rules import past_rules_hits
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sim import load_workload
from tests.bench.test_class_ceiling import one_class, parity
from tests.sim.test_prefix_bound import Requests, chained_requests


@settings(max_examples=200, deadline=None)
@given(chained_requests(), st.integers(0, 6))
def test_one_part_is_the_class_ceiling(requests: Requests, capacity: int) -> None:
    for classify in (parity, one_class):
        ceiling = class_ceiling(requests, capacity, classify).hits
        assert past_rules_hits(requests, capacity, classify, segments=1) == pytest.approx(ceiling)


@settings(max_examples=200, deadline=None)
@given(chained_requests(), st.integers(0, 6), st.integers(1, 4))
def test_never_above_the_ceiling_of_rules_chosen_per_part_in_hindsight(
    requests: Requests, capacity: int, segments: int
) -> None:
    segments = min(segments, len(requests))
    n = len(requests)

    def by_part(t: int, ids: Sequence[int]) -> list[Hashable]:
        return [(c, t * segments // n) for c in parity(t, ids)]

    learned = past_rules_hits(requests, capacity, parity, segments)
    assert 0 <= learned <= class_ceiling(requests, capacity, by_part).hits + 1e-9


def test_a_class_never_seen_holds_nothing() -> None:
    """The second half's blocks are of a class the first half never had: though they are
    reused at once and there is room, nothing is held for them."""
    requests = [[1], [1], [2], [2]]

    def halves(t: int, ids: Sequence[int]) -> list[Hashable]:
        return ["early" if t < 2 else "late"] * len(ids)

    assert past_rules_hits(requests, 1, halves, segments=2) == pytest.approx(1)
    assert past_rules_hits(requests, 1, one_class, segments=2) == pytest.approx(2)


def test_the_past_parts_hold_times_apply() -> None:
    """One class. First half: block 1 comes back after 1 request, then is never used
    again (room 7, to the trace's end after request 7): its own best rule holds 1 request
    (1 hit for 1 + 1 slot-requests). Second half: block 2 comes back after 3 requests.
    Learned from the first half, the rule holds 1 request: no hit in the second, where
    hindsight (hold 3) would hit; at any budget."""
    requests = [[1], [1], [], [], [2], [], [], [2]]
    for capacity in (1, 4):
        assert past_rules_hits(requests, capacity, one_class, segments=2) == pytest.approx(1)
        assert class_ceiling(requests, capacity, one_class).hits == pytest.approx(2)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 0, got -1"):
        past_rules_hits([[1]], -1, one_class)
    with pytest.raises(ValueError, match="segments=3; from 1 to the trace's 2 requests"):
        past_rules_hits([[1], [1]], 1, one_class, segments=3)
    with pytest.raises(ValueError, match="request 0: 0 classes for 1 blocks"):
        past_rules_hits([[1]], 1, lambda t, ids: [], segments=1)


# The README's ceiling table, "learned" rows (`.venv/bin/python -m benchmarks.bench_prefix_gap`):
# block hits on the public trace at 1% and 5% of its unique blocks (288,500 references),
# rules learned from earlier tenths for reuse's signals, hit density's online classes and
# every request-level signal
PAST_RULES_GOLDEN = {
    1827: (31035.336, 31478.195, 27997.100),
    9139: (64837.913, 65688.255, 57774.376),
}


@pytest.mark.parametrize("capacity", sorted(PAST_RULES_GOLDEN))
def test_golden_on_conversation_trace(conversation_trace_path: Path, capacity: int) -> None:
    ids = [list(r) for r in load_workload(conversation_trace_path).block_ids]
    classes = (UseClasses, OnlineClasses, SignalClasses)
    found = [past_rules_hits(ids, capacity, c()) for c in classes]
    assert found == pytest.approx(PAST_RULES_GOLDEN[capacity], abs=1e-3)
