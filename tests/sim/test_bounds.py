"""Bounds: Belady MIN with bypass equals the brute-force optimum; golden figures."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sim.bounds import (
    belady_hits,
    brute_force_hits,
    compute_bounds,
    flatten,
    infinite_hits,
    next_uses,
)
from kvtier.sim.workload import load_workload


@settings(max_examples=150, deadline=None)
@given(
    refs=st.lists(st.integers(0, 5), min_size=0, max_size=11),
    capacity=st.integers(0, 3),
)
def test_belady_matches_brute_force(refs: list[int], capacity: int) -> None:
    assert belady_hits(refs, capacity) == brute_force_hits(refs, capacity)


def test_bypass_beats_plain_min() -> None:
    """Admitting 9 (never reused soon) would cost the hit on 1; MIN with bypass keeps 1."""
    refs = [1, 9, 1]
    assert belady_hits(refs, 1) == brute_force_hits(refs, 1) == 1


def test_infinite_capacity_reaches_infinite_bound() -> None:
    requests = [(1, 2, 3), (1, 2, 4), (5, 2)]
    refs = [b for ids in requests for b in ids]
    assert infinite_hits(requests) == (3, 2)
    assert belady_hits(refs, 10) == 3


def test_next_uses() -> None:
    assert next_uses([1, 2, 1, 1]) == [2, 4, 3, 4]


def test_errors() -> None:
    with pytest.raises(ValueError, match="capacity"):
        belady_hits([1], -1)
    with pytest.raises(ValueError, match="exponential"):
        brute_force_hits(list(range(25)), 1)


# Published figures for this trace (traces/README.md): 0.246 / 0.366 / 0.366 / 0.366.
BELADY_GOLDEN = {1827: 71_078, 9139: 105_710, 18279: 105_710, 45697: 105_710}


def test_golden_bounds_on_conversation_trace(conversation_trace_path: Path) -> None:
    workload = load_workload(conversation_trace_path)
    bounds = compute_bounds(workload, 9139)
    assert (bounds.infinite_hits, bounds.infinite_prefix_hits) == (105_710, 105_710)
    assert round(bounds.infinite, 4) == 0.3664 and round(bounds.belady, 4) == 0.3664
    refs = flatten(workload)
    for capacity, hits in BELADY_GOLDEN.items():
        assert belady_hits(refs, capacity) == hits, capacity
    assert round(BELADY_GOLDEN[1827] / 288_500, 3) == 0.246
