"""`--data`: real bytes through the CPU tier, every load verified."""

from __future__ import annotations

import pytest

from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.sim.bytes_plane import DataPlane, small_layout
from kvtier.sim.generator import GeneratorConfig, generate_workload
from kvtier.sim.ledger import Ledger
from kvtier.sim.replay_config import ReplayConfig
from kvtier.sim.run import replay
from kvtier.sim.stack import TierStack, build_stack
from kvtier.sim.workload import Workload
from kvtier.types import int_block_hash

pytest.importorskip("torch")


@pytest.mark.parametrize("gpu_blocks", [0, 200])
def test_bytes_move_without_changing_decisions(gpu_blocks: int) -> None:
    workload = generate_workload(GeneratorConfig(num_requests=80), seed=4)
    config = ReplayConfig("lru", cpu_blocks=120, gpu_blocks=gpu_blocks)
    plain = replay(workload, config)
    moved = replay(workload, ReplayConfig("lru", cpu_blocks=120, gpu_blocks=gpu_blocks, data=True))
    assert (moved.prefix_hit_blocks, moved.any_hit_blocks) == (
        plain.prefix_hit_blocks,
        plain.any_hit_blocks,
    )
    cpu = moved.tiers[-1]
    assert cpu.name == "cpu" and cpu.checksum_failures == 0
    bytes_per_block = small_layout(workload.block_size).bytes_per_block
    assert cpu.bytes_stored == cpu.stores * bytes_per_block
    assert cpu.bytes_loaded == cpu.hit_blocks * bytes_per_block > 0


def _plane(workload: Workload, device_blocks: int = 4) -> tuple[DataPlane, Ledger, TierStack]:
    layout = small_layout(workload.block_size)
    stack = build_stack(workload, ReplayConfig(cpu_blocks=4, data=True), layout)
    ledger = Ledger(workload, stack.counters())
    return DataPlane(layout, device_blocks, stack, ledger), ledger, stack


def test_corrupt_slot_fails_the_load_and_is_counted() -> None:
    workload = generate_workload(GeneratorConfig(num_requests=2), seed=1)
    dp, ledger, stack = _plane(workload)
    try:
        hashes = [int_block_hash(7), int_block_hash(8)]
        dp.compute([0, 1], hashes)
        assert dp.store(CPULoadStoreSpec([2, 3]), [0, 1], hashes) == [("local", True)]
        assert dp.load(CPULoadStoreSpec([2, 3]), [1, 0], hashes[::-1]) is False  # swapped
        assert dp.load(CPULoadStoreSpec([2, 3]), [0, 1], hashes)
        dp.host.array[3][5] ^= 0xFF  # a flipped byte in the slot holding block 8
        assert not dp.load(CPULoadStoreSpec([2, 3]), [0, 1], hashes)
        dp.take_checksum_failures()
        cpu = ledger.tiers["cpu"]
        # the wrong-place load (content check) and the corrupt slot (store's checksum)
        assert cpu.checksum_failures == 2 and cpu.errors == 2
        size = small_layout(workload.block_size).bytes_per_block
        assert cpu.bytes_stored == 2 * size and cpu.bytes_loaded == 4 * size
    finally:
        dp.close()
        stack.close()


def test_bytes_through_the_disk_cascade() -> None:
    workload = generate_workload(GeneratorConfig(num_requests=60), seed=5)
    config = ReplayConfig("lru", cpu_blocks=20, disk_blocks=600)
    plain = replay(workload, config)
    moved = replay(workload, ReplayConfig("lru", cpu_blocks=20, disk_blocks=600, data=True))
    assert moved.prefix_hit_blocks == plain.prefix_hit_blocks
    assert [t.hit_blocks for t in moved.tiers] == [t.hit_blocks for t in plain.tiers]
    cpu, disk = moved.tiers
    assert disk.hit_blocks > 0 and disk.bytes_loaded > 0 and disk.bytes_stored > 0
    size = small_layout(workload.block_size).bytes_per_block
    assert disk.bytes_loaded == disk.hit_blocks * size
    assert cpu.bytes_loaded == cpu.hit_blocks * size
    assert cpu.checksum_failures == disk.checksum_failures == 0


def test_data_refuses_only_what_it_cannot_move() -> None:
    with pytest.raises(ValueError, match="store_on"):
        ReplayConfig(data=True, gpu_blocks=10, store_on="evict")
    with pytest.raises(ValueError, match="disk_dir"):
        ReplayConfig(disk_dir="/tmp/x", disk_blocks=10)


def test_a_failed_construction_leaves_no_worker_running() -> None:
    import threading

    class BrokenRemote:
        def kv_store(self, layout: object) -> object:
            raise OSError("remote tier unreachable")

    workload = generate_workload(GeneratorConfig(num_requests=2), seed=1)
    layout = small_layout(workload.block_size)
    stack = build_stack(workload, ReplayConfig(cpu_blocks=4, data=True), layout)
    stack.remote = BrokenRemote()  # type: ignore[assignment]
    before = threading.active_count()
    with pytest.raises(OSError, match="unreachable"):
        DataPlane(layout, 4, stack, Ledger(workload, stack.counters()))
    assert threading.active_count() == before  # the CPU tier's worker was closed


def test_data_without_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # as after `make demo`: no torch
    workload = generate_workload(GeneratorConfig(num_requests=2), seed=1)
    with pytest.raises(ValueError, match=r"pip install 'kvtier\[torch\]'"):
        replay(workload, ReplayConfig(data=True))
