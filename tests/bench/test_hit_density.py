"""Hit-density eviction (benchmarks/hit_density.py): a schedule of the prefix model, so
never above Belady nor the optimum, all hits with room for every block; its classes."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks.hit_density import (
    NEVER_CLASS,
    NextUseClasses,
    OnlineClasses,
    density_hits,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sim import GeneratorConfig, generate_workload
from kvtier.sim.bounds import belady_hits, infinite_hits
from kvtier.sim.prefix_bound import brute_force_prefix_hits
from kvtier.sim.workload import load_workload
from tests.sim.test_prefix_bound import Requests, chained_requests, flat


def _both(block_ids: Requests, capacity: int) -> tuple[int, int]:
    return (
        density_hits(block_ids, capacity, NextUseClasses(block_ids)),
        density_hits(block_ids, capacity, OnlineClasses()),
    )


@settings(max_examples=150, deadline=None)
@given(chained_requests(), st.integers(0, 6))
def test_never_above_the_optimum_on_small_traces(requests: Requests, capacity: int) -> None:
    optimum = brute_force_prefix_hits(requests, capacity)
    assert max(_both(requests, capacity)) <= optimum


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0.01, 0.03, 0.1, 1.0]))
def test_generated_traces_between_zero_and_belady(seed: int, fraction: float) -> None:
    """Long enough to learn and evict (the tables refresh every 128 requests)."""
    workload = generate_workload(GeneratorConfig(num_requests=600), seed=seed)
    ids = [list(r) for r in workload.block_ids]
    capacity = int(workload.unique_blocks * fraction)
    upper = belady_hits(flat(ids), capacity)
    for hits in _both(ids, capacity):
        assert 0 <= hits <= upper
        if fraction == 1.0:  # room for every block: every re-reference is a hit
            assert hits == infinite_hits(ids)[1]


def test_capacity_zero_and_negative() -> None:
    assert _both([[1, 2], [1, 2]], 0) == (0, 0)
    with pytest.raises(ValueError, match="capacity must be >= 0, got -1"):
        density_hits([[1]], -1, OnlineClasses())


def test_a_request_larger_than_the_tier_keeps_its_head() -> None:
    assert _both([[1, 2, 3], [1, 2, 3]], 2) == (2, 2)


def test_next_use_classes_are_the_bit_length_of_the_gap() -> None:
    classes = NextUseClasses([[1, 2], [1], [3], [1, 2]])
    assert classes(0, [1, 2]) == [1, 2]  # 1 is used 1 request later, 2 three later
    assert classes(1, [1]) == [2]
    assert classes(3, [1, 2]) == [NEVER_CLASS, NEVER_CLASS]


def test_online_classes_count_uses_and_turns() -> None:
    classify = OnlineClasses()
    assert classify(0, [0, 1, 2]) == [(1, 1), (1, 1), "last"]
    # a shared first block only: a new conversation, turn 1
    assert classify(1, [0, 5]) == [(2, 1), "last"]
    # extends request 0 beyond its first block: turn 2, its blocks used twice
    assert classify(2, [0, 1, 2, 3]) == [(3, 2), (2, 2), (2, 2), "last"]
    assert classify(3, [0, 1, 2, 3, 4]) == [(4, 3), (3, 3), (3, 3), (2, 3), "last"]
    assert classify(4, [0, 1]) == [(4, 4), (4, 4)]  # nothing new: no "last"


# The README's "Which policy" paragraph (`.venv/bin/python -m benchmarks.bench_prefix_gap`):
# prefix hits on the public trace at 1% and 5% of its unique blocks, told when / online
DENSITY_GOLDEN = {1827: (57_069, 28_878), 9139: (98_384, 62_770)}


@pytest.mark.parametrize("capacity", sorted(DENSITY_GOLDEN))
def test_golden_on_conversation_trace(conversation_trace_path: Path, capacity: int) -> None:
    workload = load_workload(conversation_trace_path)
    ids = [list(r) for r in workload.block_ids]
    assert _both(ids, capacity) == DENSITY_GOLDEN[capacity]
