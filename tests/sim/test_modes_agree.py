"""Every mode counts alike: with and without real bytes, every per-tier figure is equal.

The bytes plane only adds bytes moved and verified; the clock decides when completions
land, not how they are counted. So on a fault-free run, `data=True` changes no figure
but the byte counts, for every combination of tiers, with or without the time model.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.sim.generator import GeneratorConfig, generate_workload
from kvtier.sim.replay_config import ReplayConfig, TimeModel
from kvtier.sim.run import replay
from tests.sim.test_faults import figures

pytest.importorskip("torch")

SMALL = generate_workload(GeneratorConfig(num_requests=50), seed=3)

TIERS = {
    "cpu": {},
    "cpu-filter": {"store_threshold": 2},
    "gpu+cpu": {"gpu_blocks": 250},
    "cpu+disk": {"disk_blocks": 400},
    "cpu+disk-filter": {"disk_blocks": 400, "store_threshold": 2},
    "gpu+cpu+disk": {"gpu_blocks": 250, "disk_blocks": 400},
}


@pytest.mark.parametrize("concurrent", [False, True], ids=["at-once", "virtual-time"])
@pytest.mark.parametrize("tiers", list(TIERS))
def test_every_figure_is_equal_with_and_without_bytes(tiers: str, concurrent: bool) -> None:
    model = TimeModel() if concurrent else None
    config = ReplayConfig("lru", cpu_blocks=40, time_model=model, **TIERS[tiers])  # type: ignore[arg-type]
    plain, moved = replay(SMALL, config), replay(SMALL, replace(config, data=True))
    assert figures(plain) == figures(moved)
    assert all(t.checksum_failures == t.errors == t.dropped_blocks == 0 for t in moved.tiers)
    assert sum(t.bytes_loaded for t in moved.tiers) > 0


def test_the_filtered_stores_drift_is_gone() -> None:
    """Generated workload, LRU, --cpu-frac 0.05 --store-threshold 2, 400 requests: the
    data-plane loop counted no filtered stores (0 against 6,489)."""
    workload = generate_workload(GeneratorConfig(), seed=0).limited(400)
    config = ReplayConfig("lru", cpu_frac=0.05, store_threshold=2)
    (plain,), (moved,) = (
        replay(workload, config).tiers,
        replay(workload, replace(config, data=True)).tiers,
    )
    assert plain.filtered_stores == moved.filtered_stores == 6_489


def test_the_general_step_counts_like_the_fast_loop_with_bytes_too() -> None:
    config = ReplayConfig("arc", cpu_blocks=60)
    fast = replay(SMALL, config)
    assert figures(fast) == figures(replay(SMALL, config, general=True))
    assert figures(fast) == figures(replay(SMALL, replace(config, data=True)))


def test_a_disk_dir_persists_across_runs_and_says_what_it_found(tmp_path: Path) -> None:
    config = ReplayConfig("lru", cpu_blocks=20, disk_blocks=400, data=True, disk_dir=str(tmp_path))
    first = replay(SMALL, config)
    assert first.extra["disk_recovery"]["recovered_blocks"] == 0  # type: ignore[index]
    second = replay(SMALL, config)
    recovery = second.extra["disk_recovery"]
    assert recovery["recovered_blocks"] > 0 and recovery["directory"].startswith(str(tmp_path))  # type: ignore[index]
    # blocks the first run left on disk serve the second from its first request
    assert second.tiers[1].hit_blocks > first.tiers[1].hit_blocks
    assert second.prefix_hit_blocks > first.prefix_hit_blocks
    assert all(t.checksum_failures == t.errors == 0 for t in second.tiers)
