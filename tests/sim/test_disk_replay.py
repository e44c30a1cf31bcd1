"""The replay with the CPU->disk cascade (bookkeeping: no bytes)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sim.bounds import belady_hits, flatten
from kvtier.sim.generator import GeneratorConfig, generate_workload
from kvtier.sim.replay_config import ReplayConfig
from kvtier.sim.run import replay
from kvtier.sim.traces import TraceRequest
from kvtier.sim.workload import Workload


def test_disk_serves_what_the_cpu_tier_demoted() -> None:
    workload = generate_workload(GeneratorConfig(num_requests=200), seed=5)
    alone = replay(workload, ReplayConfig("lru", cpu_blocks=50))
    both = replay(workload, ReplayConfig("lru", cpu_blocks=50, disk_blocks=2000))
    cpu, disk = both.tiers
    assert (cpu.name, disk.name) == ("cpu", "disk")
    assert (cpu.capacity, disk.capacity) == (50, 2000)
    assert disk.hit_blocks > 0 and disk.stores > 0
    assert cpu.hit_blocks + disk.hit_blocks == both.prefix_hit_blocks > alone.prefix_hit_blocks


def test_disk_behind_the_accelerator() -> None:
    workload = generate_workload(GeneratorConfig(num_requests=150), seed=6)
    r = replay(workload, ReplayConfig("arc", gpu_blocks=300, cpu_blocks=40, disk_blocks=800))
    assert [t.name for t in r.tiers] == ["gpu", "cpu", "disk"]
    assert sum(t.hit_blocks for t in r.tiers) == r.prefix_hit_blocks
    assert r.tiers[2].hit_blocks > 0


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(
        st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True).map(tuple),
        min_size=1,
        max_size=12,
    ),
    cpu=st.integers(1, 4),
    disk=st.integers(1, 6),
    threshold=st.sampled_from([0, 2]),
)
def test_cascade_stays_below_belady_at_total_capacity(
    requests: list[tuple[int, ...]], cpu: int, disk: int, threshold: int
) -> None:
    rows = tuple(TraceRequest(float(i), 4 * len(ids), 1, ids) for i, ids in enumerate(requests))
    w = Workload("h", rows, 4, chained=True)
    r = replay(w, ReplayConfig("lru", cpu_blocks=cpu, disk_blocks=disk, store_threshold=threshold))
    assert r.prefix_hit_blocks <= r.any_hit_blocks
    assert r.any_hit_blocks <= belady_hits(flatten(w), cpu + disk)
