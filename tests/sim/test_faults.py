"""Figures stay honest when a tier fails: a failing tier never makes the replay look better.

Each fault is injected into the real bytes plane (`data=True`): a disk that is full
(every write raises ENOSPC), block files corrupted as soon as they are written. The
hit rates must not exceed those of the same run without that tier, every failed
transfer must be counted as an error, and what never reached a tier is not a store.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

import pytest

from kvtier.sim.generator import GeneratorConfig, generate_workload
from kvtier.sim.metrics import ReplayResult
from kvtier.sim.replay_config import ReplayConfig, TimeModel
from kvtier.sim.run import replay
from kvtier.sim.workload import Workload
from kvtier.store.disk_store import DiskStore
from kvtier.types import BlockHash

pytest.importorskip("torch")

WORKLOAD = generate_workload(GeneratorConfig(num_requests=70), seed=0)


def _full_disk(self: DiskStore, hashes: Sequence[BlockHash], blocks: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


_write_parts = DiskStore.write_parts


def _corrupting(self: DiskStore, hashes: Sequence[BlockHash], blocks: object) -> None:
    _write_parts(self, hashes, blocks)  # type: ignore[arg-type]
    for block_hash in hashes:  # flip the last payload byte of every file just written
        with open(self._path(block_hash), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last ^ 0xFF]))


def _rates(r: ReplayResult) -> tuple[float, float]:
    return r.hit_rate, r.prefix_hit_rate


CASES = [
    pytest.param({}, id="cpu"),
    pytest.param({"gpu_blocks": 200}, id="gpu+cpu"),
    pytest.param({"time_model": TimeModel()}, id="cpu-concurrent"),
]


@pytest.mark.parametrize("tiers", CASES)
@pytest.mark.parametrize("fault", [_full_disk, _corrupting], ids=["full", "corrupt"])
def test_a_failing_disk_never_raises_the_hit_rates(
    monkeypatch: pytest.MonkeyPatch, tiers: dict[str, object], fault: object
) -> None:
    config = ReplayConfig("lru", cpu_blocks=60, data=True, **tiers)  # type: ignore[arg-type]
    without = replay(WORKLOAD, config)
    healthy = replay(WORKLOAD, _with_disk(config))
    assert healthy.tiers[-1].hit_blocks > 0 and _rates(healthy) > _rates(without)
    monkeypatch.setattr(DiskStore, "write_parts", fault)
    broken = replay(WORKLOAD, _with_disk(config))
    assert broken.hit_rate <= without.hit_rate
    assert broken.prefix_hit_rate <= without.prefix_hit_rate
    disk = broken.tiers[-1]
    assert disk.name == "disk" and disk.hit_blocks == disk.bytes_loaded == 0
    assert disk.errors > 0
    assert sum(t.hit_blocks for t in broken.tiers) == broken.prefix_hit_blocks
    if fault is _full_disk:  # nothing reached the disk: no stores, no bytes written
        assert disk.stores == disk.bytes_stored == 0
        assert disk.dropped_blocks > 0  # demoted blocks lost on the way
    else:  # written, then found corrupt when loaded: counted, forgotten
        assert disk.checksum_failures > 0 and disk.dropped_blocks > 0


def _with_disk(config: ReplayConfig) -> ReplayConfig:
    from dataclasses import replace

    return replace(config, disk_blocks=2000)


def test_fault_free_figures_equal_with_and_without_bytes_on_the_public_trace(
    conversation_trace_path: object,
) -> None:
    from pathlib import Path

    from kvtier.sim.workload import load_workload

    workload = load_workload(Path(str(conversation_trace_path)), limit=60)
    for extra in ({}, {"gpu_blocks": 400}, {"time_model": TimeModel()}):
        config = ReplayConfig("lru", cpu_blocks=150, disk_blocks=600, **extra)  # type: ignore[arg-type]
        _assert_same_figures(workload, config)


def _assert_same_figures(workload: Workload, config: ReplayConfig) -> None:
    from dataclasses import replace

    plain, moved = replay(workload, config), replay(workload, replace(config, data=True))
    assert figures(plain) == figures(moved)
    assert all(t.checksum_failures == t.errors == 0 for t in moved.tiers)


def figures(r: ReplayResult) -> tuple[object, ...]:
    """Everything but timings and bytes (which only a bytes plane moves)."""
    tiers = tuple(
        {k: v for k, v in t.__dict__.items() if k not in ("bytes_loaded", "bytes_stored")}
        for t in r.tiers
    )
    return (
        r.any_hit_blocks,
        r.prefix_hit_blocks,
        r.hit_tokens,
        r.prefill_tokens_saved,
        tiers,
        r.extra,
    )
