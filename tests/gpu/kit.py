"""Caches of every engine layout on any device, filled with seeded bytes, read back
independently of the copy code; and the tiers a worker moves them to."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.offload.disk_manager import DiskLoadStoreSpec
from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.store.disk_store import DiskStore
from kvtier.store.layout import KVLayout
from kvtier.store.memory import MemoryStore
from kvtier.transfer.device import DeviceKV, allocate_kv_caches
from kvtier.transfer.pages import PagedDeviceKV, allocate_pages
from kvtier.transfer.transfer_worker import TransferResult, TransferWorker
from kvtier.types import BlockHash

# 16-token blocks of 4 layers, 4 KV heads of 64 (bf16): 32 KiB a block, 4 KiB a segment.
BASE = KVLayout(num_layers=4, num_kv_heads=4, head_size=64, block_size=16, dtype="bfloat16")
# kvtier's two layouts, and vLLM's pages (what its offloading connector registers).
LAYOUTS = ["per_layer", "cross_layer", "pages"]


def layout_of(name: str, base: KVLayout = BASE) -> KVLayout:
    if name not in LAYOUTS:
        raise ValueError(f"layout {name!r}; known: {LAYOUTS}")
    if name == "pages":  # vLLM's view: bytes, one "head" per plane row
        plane = base.block_size * base.num_kv_heads * base.head_size * base.itemsize
        return KVLayout(base.num_layers, 1, plane // base.block_size, base.block_size, "uint8")
    return dataclasses.replace(base, per_layer=name == "per_layer")


def make_kv(name: str, num_blocks: int, device: torch.device, seed: int) -> DeviceKV:
    """A cache of layout `name` on `device`, filled with seeded random bytes."""
    layout = layout_of(name)
    if name == "pages":
        kv: DeviceKV = PagedDeviceKV(layout, allocate_pages(layout, num_blocks, device))
    else:
        kv = DeviceKV(layout, allocate_kv_caches(layout, num_blocks, device))
    fill(kv, seed)
    return kv


def fill(kv: DeviceKV, seed: int, block_ids: Sequence[int] | None = None) -> None:
    """Seeded random bytes into `block_ids` (default all), the same on every device."""
    generator = torch.Generator().manual_seed(seed)
    ids = list(range(kv.num_blocks)) if block_ids is None else list(block_ids)
    for seg in kv.segments:
        noise = torch.randint(0, 256, (len(ids), seg.shape[1]), generator=generator)
        seg[ids] = noise.to(torch.uint8).to(seg.device)


def block_bytes(kv: DeviceKV, block_id: int) -> bytes:
    """One block in host byte order, read on the compute stream (not kvtier's copies)."""
    return b"".join(seg[block_id].cpu().numpy().tobytes() for seg in kv.segments)


def slot_bytes(store: MemoryStore, slot: int) -> bytes:
    return b"".join(bytes(part) for part in store.slot_parts([slot])[0])


def keys(*ids: int) -> list[BlockHash]:
    return [BlockHash(i.to_bytes(8, "big")) for i in ids]


class Tier:
    """One tier a device cache moves to: the CPU tier's slots or the disk's files."""

    def __init__(self, name: str, kv: DeviceKV, root: Path, num_blocks: int) -> None:
        self.name = name
        self.store: MemoryStore | DiskStore
        if name == "cpu":
            self.store = MemoryStore(kv.layout, num_blocks)
        elif name == "disk":
            capacity = DiskStore.capacity_for(kv.layout, num_blocks)
            self.store = DiskStore(root, kv.layout, capacity, fsync=False)
        else:
            raise ValueError(f"tier {name!r}; known: cpu, disk")
        self.worker = TransferWorker.for_store(kv, self.store)

    def spec(self, slots: Sequence[int]) -> LoadStoreSpec:
        if isinstance(self.store, MemoryStore):
            return CPULoadStoreSpec(list(slots))
        return DiskLoadStoreSpec(keys(*slots), list(slots))

    def stored_bytes(self, slot: int) -> bytes:
        """What the tier holds for `slot`, read without the worker."""
        if isinstance(self.store, MemoryStore):
            return slot_bytes(self.store, slot)
        out = np.zeros(self.store.layout.bytes_per_block, dtype=np.uint8)
        self.store.read_blocks(self.spec([slot]), [memoryview(out)])
        return out.tobytes()

    def close(self) -> None:
        self.worker.close()
        if isinstance(self.store, DiskStore):
            self.store.close()


def run_jobs(
    worker: TransferWorker, jobs: Sequence[tuple[str, int, Sequence[int], LoadStoreSpec]]
) -> list[TransferResult]:
    """Submit ("store" | "load", job id, device ids, spec) jobs, wait, assert all ok."""
    for kind, job_id, ids, spec in jobs:
        ok = (
            worker.submit_store(job_id, ids, spec)
            if kind == "store"
            else worker.submit_load(job_id, spec, ids)
        )
        assert ok, f"{kind} job {job_id} rejected"
    assert worker.wait([job_id for _, job_id, _, _ in jobs], timeout=120)
    results = worker.get_finished()
    assert [r.ok for r in results] == [True] * len(results), (results, list(worker.errors))
    return results


def spin(seconds: float) -> None:
    """Keep the current CUDA stream busy for about `seconds` (a kernel still running)."""
    torch.cuda._sleep(int(seconds * _cycles_per_second()))  # type: ignore[no-untyped-call]


_CYCLES: list[float] = []


def _cycles_per_second() -> float:
    if not _CYCLES:  # measured once: clock rates differ between cards
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # type: ignore[no-untyped-call]  # warm-up
        start.record()
        torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
        end.record()
        end.synchronize()
        _CYCLES.append(50_000_000 / (start.elapsed_time(end) / 1000))
    return _CYCLES[0]
