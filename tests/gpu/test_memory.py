"""Memory comes back: after many jobs the device's allocations, the pinned host memory
and the worker's own bookkeeping are where they were after the first round."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from kvtier.store.memory import MemoryStore
from kvtier.transfer.handlers import StagedHandler
from tests.gpu.kit import LAYOUTS, Tier, block_bytes, make_kv, run_jobs

ROUNDS = 60


def _held(device: torch.device, tier: Tier) -> dict[str, int]:
    """What the data plane holds now: device bytes, pinned bytes in use, staging, jobs."""
    held = {"jobs": tier.worker.num_in_flight}
    handler = tier.worker.handler
    if isinstance(handler, StagedHandler):
        held["staging"] = handler.staging_bytes
    if device.type == "cuda":
        torch.cuda.synchronize()
        held["device"] = torch.cuda.memory_allocated(device)
        held["pinned"] = pinned_in_use()
    return held


def pinned_in_use() -> int:
    """Bytes of pinned host memory torch's host allocator holds (handed out or cached for
    reuse): a copy path that pinned afresh for every job would grow it without end."""
    torch.cuda.synchronize()
    return int(torch.cuda.host_memory_stats()["allocated_bytes.current"])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier_name", ["cpu", "disk"])
def test_many_jobs_leave_memory_where_it_was(
    device: torch.device, layout: str, tier_name: str, tmp_path: Path
) -> None:
    kv = make_kv(layout, 64, device, seed=1)
    tier = Tier(tier_name, kv, tmp_path, num_blocks=32)

    def one_round(job: int) -> None:  # stores and loads of every shape the engine sends
        stores = [
            ("store", job, range(8), tier.spec(range(8))),
            ("store", job + 1, [30, 12, 21], tier.spec([8, 9, 10])),
        ]
        run_jobs(tier.worker, stores)  # then loads of what they stored (another thread)
        loads = [
            ("load", job + 2, range(40, 48), tier.spec(range(8))),
            ("load", job + 3, [60, 3, 50], tier.spec([10, 8, 9])),
        ]
        run_jobs(tier.worker, loads)

    try:
        one_round(0)
        after_first = _held(device, tier)
        for r in range(1, ROUNDS):
            one_round(4 * r)
        assert _held(device, tier) == after_first
        assert after_first["jobs"] == 0
    finally:
        tier.close()


def test_a_closed_tier_lets_go_of_its_memory(device: torch.device, tmp_path: Path) -> None:
    kv = make_kv("per_layer", 16, device, seed=2)
    tier = Tier("cpu", kv, tmp_path, num_blocks=16)
    run_jobs(tier.worker, [("store", 0, range(16), tier.spec(range(16)))])
    assert isinstance(tier.store, MemoryStore)
    buffer = weakref.ref(tier.store.buffer)
    tier.close()
    del tier
    gc.collect()
    assert buffer() is None, "something still holds the CPU tier's buffer"
    if device.type == "cuda":  # torch's host allocator has it back: a new tier reuses it
        held = pinned_in_use()
        again = Tier("cpu", kv, tmp_path, num_blocks=16)
        run_jobs(again.worker, [("store", 0, range(16), again.spec(range(16)))])
        assert pinned_in_use() == held
        again.close()


def test_the_disk_moves_a_cpu_engines_pages_in_place(tmp_path: Path) -> None:
    """vLLM's pages on the CPU (each plane's rows a page apart): the disk reads into and
    writes from the engine's blocks where they lie, with no staging rows at all."""
    kv = make_kv("pages", 16, torch.device("cpu"), seed=3)
    tier = Tier("disk", kv, tmp_path, num_blocks=8)
    try:
        run_jobs(tier.worker, [("store", 0, [1, 5, 2], tier.spec([0, 1, 2]))])
        run_jobs(tier.worker, [("load", 1, [9, 10, 11], tier.spec([2, 0, 1]))])
        assert [block_bytes(kv, b) for b in (9, 10, 11)] == [block_bytes(kv, b) for b in (2, 1, 5)]
        assert [tier.stored_bytes(s) for s in (0, 1)] == [block_bytes(kv, b) for b in (1, 5)]
        handler = tier.worker.handler
        assert isinstance(handler, StagedHandler) and handler.staging_bytes == 0
    finally:
        tier.close()
