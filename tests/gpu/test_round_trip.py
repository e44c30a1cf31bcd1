"""Stores and loads between the engine's caches (every layout) and the CPU and disk
tiers, on CPU tensors and on CUDA ones: every byte checked both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.transfer import handlers
from tests.gpu.kit import LAYOUTS, Tier, block_bytes, fill, make_kv, run_jobs

NUM_BLOCKS = 48


@pytest.fixture(params=["kernel", "dma"])
def copy_path(
    request: pytest.FixtureRequest, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> str:
    """On a GPU the CPU tier's handler picks, per job, one kernel or a DMA per segment and
    run (`cuda_copy.prefer_kernel`): each is forced in turn. Elsewhere: torch copies."""
    if request.param == "kernel" and device.type != "cuda":
        pytest.skip("the copy kernel needs CUDA")
    want = request.param == "kernel"
    monkeypatch.setattr(handlers, "prefer_kernel", lambda *args: want)
    return str(request.param)


# (device ids, tier slots): a run consecutive on both sides, shuffled ids, a reversed run
STORES = [
    (list(range(8)), list(range(8))),
    ([20, 13, 9, 30], [8, 9, 10, 11]),
    ([19, 18, 17], [14, 13, 12]),
]
LOADS = [
    (list(range(12, 15)), list(range(40, 43))),
    (list(range(8)), [47, 33, 34, 35, 36, 21, 22, 2]),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier_name", ["cpu", "disk"])
def test_every_byte_survives_a_store_and_a_load(
    device: torch.device, layout: str, tier_name: str, copy_path: str, tmp_path: Path
) -> None:
    kv = make_kv(layout, NUM_BLOCKS, device, seed=1)
    tier = Tier(tier_name, kv, tmp_path, num_blocks=16)
    try:
        run_jobs(
            tier.worker,
            [("store", i, ids, tier.spec(slots)) for i, (ids, slots) in enumerate(STORES)],
        )
        expected = {
            slot: block_bytes(kv, d)
            for ids, slots in STORES
            for d, slot in zip(ids, slots, strict=True)
        }
        for slot, data in expected.items():
            assert tier.stored_bytes(slot) == data, f"{layout} {tier_name}: slot {slot} differs"
        fill(kv, seed=2)  # the engine reuses its blocks: loads must bring every byte back
        run_jobs(
            tier.worker,
            [("load", 10 + i, ids, tier.spec(slots)) for i, (slots, ids) in enumerate(LOADS)],
        )
        for slots, ids in LOADS:
            for slot, d in zip(slots, ids, strict=True):
                assert block_bytes(kv, d) == expected[slot], f"{layout} {tier_name}: block {d}"
    finally:
        tier.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_load_writes_only_its_blocks(device: torch.device, layout: str, tmp_path: Path) -> None:
    kv = make_kv(layout, NUM_BLOCKS, device, seed=3)
    tier = Tier("cpu", kv, tmp_path, num_blocks=4)
    try:
        run_jobs(tier.worker, [("store", 0, [5, 6], tier.spec([0, 1]))])
        before = {b: block_bytes(kv, b) for b in range(NUM_BLOCKS)}
        run_jobs(tier.worker, [("load", 1, [40, 11], tier.spec([1, 0]))])
        after = {b: block_bytes(kv, b) for b in range(NUM_BLOCKS)}
    finally:
        tier.close()
    assert after[40] == before[6] and after[11] == before[5]
    assert {b for b in after if after[b] != before[b]} <= {40, 11}
