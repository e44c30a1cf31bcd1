"""The replay with an accelerator tier, through the connector."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sim.bounds import belady_hits, flatten
from kvtier.sim.replay_config import ReplayConfig, TimeModel
from kvtier.sim.run import replay
from kvtier.sim.traces import TraceRequest
from kvtier.sim.workload import Workload, load_workload


def _workload(*requests: tuple[int, ...], gap: float = 1000.0, tail: int = 1) -> Workload:
    rows = tuple(
        TraceRequest(i * gap, len(ids) * 4 + tail, 100, ids) for i, ids in enumerate(requests)
    )
    return Workload("t", rows, 4, chained=True)


def test_tiers_split_the_hits() -> None:
    # GPU pool 6: r1 evicts r0's tail from the GPU; r2 gets the head from the GPU and
    # the tail from the CPU tier.
    w = _workload((1, 2, 3, 4), (1, 2, 5, 6, 7), (1, 2, 3, 4))
    r = replay(w, ReplayConfig(gpu_blocks=6, cpu_blocks=16))
    gpu, cpu = r.tiers
    assert (gpu.name, gpu.hit_blocks, cpu.name, cpu.hit_blocks) == ("gpu", 4, "cpu", 2)
    assert r.prefix_hit_blocks == 6 and r.hit_tokens == 24
    assert cpu.stores == 7  # every block computed once is stored (store on compute)


def test_store_on_eviction_stores_less() -> None:
    w = _workload((1, 2, 3, 4), (1, 2, 5, 6, 7), (1, 2, 3, 4))
    r = replay(w, ReplayConfig(gpu_blocks=6, cpu_blocks=16, store_on="evict"))
    # Stored: 4 and 3 (evicted by r1), then 7 and 6 (evicted by r2); never 1, 2, 5.
    assert r.tiers[1].stores == 4 and r.tiers[1].hit_blocks == 2


def test_too_large_for_the_pool_is_counted() -> None:
    w = _workload((1, 2, 3, 4, 5, 6), (1, 2))
    for model in (None, TimeModel()):
        r = replay(w, ReplayConfig(gpu_blocks=4, cpu_blocks=8, time_model=model))
        assert r.extra["unschedulable_requests"] == 1


def test_concurrent_requests_wait_for_room() -> None:
    # Pool of 4: the second needs 2 new blocks while the first holds 3: it waits.
    w = _workload((1, 2), (1, 2, 3), gap=0.0)
    r = replay(w, ReplayConfig(gpu_blocks=4, cpu_blocks=8, time_model=TimeModel()))
    assert r.extra == {"unschedulable_requests": 0, "waited": 1, "evicted_blocks_dropped": 0}
    assert r.tiers[0].hit_blocks == 2  # it then hits the first one's blocks on the GPU


def test_concurrent_request_does_not_hit_blocks_still_loading() -> None:
    # r1 evicts r0 from the 8-block GPU pool; r2 loads r0's blocks from the CPU tier
    # and r3 (same prefix) arrives while that load is in flight: the GPU copies have
    # no bytes yet, so r3 must load from the CPU tier too, not hit them on the GPU.
    rows = tuple(
        TraceRequest(ts, len(ids) * 4 + 1, 100, ids)
        for ts, ids in (
            (0.0, (1, 2, 3)),
            (10_000.0, (7, 8, 9, 10, 11, 12, 13)),
            (20_000.0, (1, 2, 3)),
            (20_000.1, (1, 2, 3)),
        )
    )
    w = Workload("t", rows, 4, chained=True)
    r = replay(w, ReplayConfig(gpu_blocks=8, cpu_blocks=16, time_model=TimeModel()))
    gpu, cpu = r.tiers
    assert (gpu.hit_blocks, cpu.hit_blocks) == (0, 6)
    assert r.extra == {"unschedulable_requests": 0, "waited": 0, "evicted_blocks_dropped": 0}


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(
        st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True).map(tuple),
        min_size=1,
        max_size=10,
    ),
    gpu=st.integers(2, 8),
    cpu=st.integers(1, 6),
    concurrent=st.booleans(),
    store_on=st.sampled_from(["compute", "evict"]),
)
def test_hits_stay_below_belady_at_total_capacity(
    requests: list[tuple[int, ...]], gpu: int, cpu: int, concurrent: bool, store_on: str
) -> None:
    w = _workload(*requests, gap=1.0)
    model = TimeModel() if concurrent else None
    cfg = ReplayConfig(
        gpu_blocks=gpu,
        cpu_blocks=cpu,
        time_model=model,
        store_on=store_on,  # type: ignore[arg-type]
    )
    r = replay(w, cfg)
    assert r.prefix_hit_blocks <= r.any_hit_blocks <= w.block_refs - w.unique_blocks
    if not concurrent:  # waiting requests run out of arrival order: Belady's stream differs
        assert r.any_hit_blocks <= belady_hits(flatten(w), gpu + cpu)


@pytest.mark.slow
def test_golden_with_accelerator_tier(conversation_trace_path: Path) -> None:
    workload = load_workload(conversation_trace_path, limit=4000)
    r = replay(workload, ReplayConfig(gpu_blocks=2000, cpu_blocks=4000))
    gpu, cpu = r.tiers
    assert (gpu.hit_blocks, cpu.hit_blocks, r.any_hit_blocks) == GOLDEN_TIERED


# (GPU prefix hits, CPU prefix hits, any-position hits) on the first 4,000 requests.
GOLDEN_TIERED = (5160, 3941, 9134)


def test_refused_stores_are_not_counted_as_filtered() -> None:
    w = _workload((1, 2), (3, 4))
    r = replay(w, ReplayConfig(gpu_blocks=8, cpu_blocks=0))
    cpu = r.tiers[1]
    assert (cpu.stores, cpu.filtered_stores, cpu.store_rejections) == (0, 0, 2)
    filtered = replay(w, ReplayConfig(gpu_blocks=8, cpu_blocks=8, store_threshold=2)).tiers[1]
    assert (filtered.stores, filtered.filtered_stores, filtered.store_rejections) == (0, 4, 0)


def test_evicted_blocks_the_tier_refuses_are_reported_as_dropped() -> None:
    w = _workload((1, 2, 3, 4), (5, 6, 7, 8))
    # r1 evicts r0's four blocks from the 5-block pool at once; a 2-block tier can't take them
    r = replay(w, ReplayConfig(gpu_blocks=5, cpu_blocks=2, store_on="evict"))
    assert r.extra["evicted_blocks_dropped"] == 4 and r.tiers[1].store_rejections == 1
    roomy = replay(w, ReplayConfig(gpu_blocks=5, cpu_blocks=8, store_on="evict"))
    assert roomy.extra["evicted_blocks_dropped"] == 0 and roomy.tiers[1].stores == 4
