"""The data plane of the CPU -> disk cascade: one job runs everything its spec lists.

Order inside a job is fixed here: a demotion reads CPU slots the same job is about
to overwrite, so it runs first; write-through disk copies are taken from the CPU
slots just written (no second device read); a promotion copies freshly loaded
device blocks into their new CPU slots after the load. Any failure fails the job,
except a demotion's: the evicted blocks are not the job's, so a failed demotion
is recorded (`take_lost`) for the scheduler to forget, and the job goes on.

Jobs must run in submission order across directions (`TransferWorker(...,
ordered=True)`, which `worker()` builds): a block being demoted is read from its old
CPU slot by any load submitted before the job that overwrites that slot, and from
disk by any load submitted after it. The one exception is a load that only reads ready
blocks (`load_may_pass`): it goes ahead of queued stores, so a CPU hit never waits for
the disk writes queued before it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.offload.cascade_manager import CascadeLoadSpec, CascadeStoreSpec, Demotion
from kvtier.offload.disk_manager import DiskLoadStoreSpec
from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.store.disk_store import DiskStore
from kvtier.store.memory import MemoryStore
from kvtier.store.protocol import BlockLoadError, Guard, holding
from kvtier.store.shared_disk import SharedDiskStore
from kvtier.transfer.device import DeviceKV
from kvtier.transfer.handlers import HostSlotHandler, StagedHandler
from kvtier.transfer.transfer_worker import TransferWorker
from kvtier.types import BlockHash

log = logging.getLogger(__name__)


class CascadeHandler:
    """Moves the bytes of `CascadeStoreSpec` / `CascadeLoadSpec` jobs."""

    def __init__(
        self,
        kv: DeviceKV,
        memory: MemoryStore,
        disk: DiskStore | SharedDiskStore,
        *,
        copy_threads: int = 1,
    ) -> None:
        self.kv = kv
        self.memory = memory
        self.disk = disk
        self._host = HostSlotHandler(kv, memory, copy_threads=copy_threads)
        self._staged = StagedHandler(kv, disk)
        self._lost: list[BlockHash] = []
        # CPU slot -> the block whose demotion from it failed (the slot is reused since).
        # Keyed by slot, so it holds at most one entry per slot: a load naming (slot,
        # block) runs before any later demotion from that slot (see `_load_disk`).
        self._failed_demotions: dict[int, BlockHash] = {}
        self._lock = threading.Lock()
        # Demotions that never reached the disk, and their blocks, since creation: the
        # job goes on, so only these say that the disk tier's store failed.
        self.failed_demotions = 0
        self.failed_demotion_blocks = 0

    def close(self) -> None:
        self._host.close()

    def discard(self, block_hashes: list[BlockHash]) -> None:
        """Delete disk blocks the scheduler let go of (`TransferWorker.submit_discard`)."""
        self.disk.discard(block_hashes)

    @classmethod
    def worker(
        cls, kv: DeviceKV, memory: MemoryStore, disk: DiskStore, *, max_queued_jobs: int = 64
    ) -> TransferWorker:
        """An ordered worker (one thread, submission order) for this handler."""
        return TransferWorker(cls(kv, memory, disk), max_queued_jobs=max_queued_jobs, ordered=True)

    @staticmethod
    def load_may_pass(spec: Any) -> bool:
        """Whether a load may run ahead of the stores and discards queued before it (see
        `TransferWorker`'s ordered queue): one that only reads blocks ready in their tier
        depends on none of them (a ready block's CPU slot or file is written by no job in
        flight, and no discard names it), where a load's demotion or promotion writes
        slots or files whose earlier jobs must run first, and a block still being demoted
        is read from a slot that a queued job may be about to overwrite."""
        return (
            isinstance(spec, CascadeLoadSpec)
            and spec.demotion is None
            and spec.promotion is None
            and not spec.demoting
        )

    def ready_event(self) -> Any:
        return self.kv.record_compute()

    def take_lost(self) -> list[BlockHash]:
        """Demoted blocks that never reached the disk, plus blocks the disk dropped."""
        with self._lock:
            lost, self._lost = self._lost, []
        return lost + self.disk.take_dropped()

    def store(self, device_ids: npt.NDArray[np.int64], spec: LoadStoreSpec, ready: Any) -> int:
        if not isinstance(spec, CascadeStoreSpec):
            raise TypeError(f"cascade store job needs a CascadeStoreSpec, got {spec!r}")
        self._demote(spec.demotion)
        moved = 0
        if spec.cpu is not None and spec.cpu_positions:
            moved += self._host.store(device_ids[spec.cpu_positions], spec.cpu, ready)
        if spec.disk is not None:
            in_cpu = {p: i for i, p in enumerate(spec.cpu_positions)}
            if spec.cpu is not None and all(p in in_cpu for p in spec.disk_positions):
                slots = self.memory.slot_ids(spec.cpu)[[in_cpu[p] for p in spec.disk_positions]]
                self.disk.write_segments(spec.disk, self.memory.slot_parts(slots))  # write-through
                moved += len(slots) * self.kv.layout.bytes_per_block
            else:
                moved += self._staged.store(device_ids[spec.disk_positions], spec.disk, ready)
        return moved

    def load(
        self, spec: LoadStoreSpec, device_ids: npt.NDArray[np.int64], ready: Any = None
    ) -> int:
        if not isinstance(spec, CascadeLoadSpec):
            raise TypeError(f"cascade load job needs a CascadeLoadSpec, got {spec!r}")
        self._demote(spec.demotion)
        # a load with a deadline (`spec.guard`): every copy into the engine's blocks, and
        # the promotion out of them, runs under the guard, so a load given up while a
        # disk read hangs leaves the blocks (being recomputed) and the CPU slots alone
        guard: Guard | None = spec.guard
        moved = 0
        if spec.cpu is not None:
            with holding(guard, "a cascade load's CPU blocks"):
                moved += self._host.load(spec.cpu, device_ids[spec.cpu_positions], ready)
        if spec.disk is not None:
            moved += self._load_disk(spec, device_ids, ready, guard)
        if spec.promotion is not None:
            promoted = device_ids[spec.promotion_positions]
            with holding(guard, "a cascade load's promotion"):
                moved += self._host.store(promoted, spec.promotion, None)
        return moved

    def _load_disk(
        self,
        spec: CascadeLoadSpec,
        device_ids: npt.NDArray[np.int64],
        ready: Any,
        guard: Guard | None,
    ) -> int:
        """Disk blocks; those still being demoted come from their old CPU slot."""
        if not isinstance(spec.disk, DiskLoadStoreSpec):
            raise TypeError(f"cascade disk part needs a DiskLoadStoreSpec, got {spec.disk!r}")
        hashes, positions = spec.disk.block_hashes, spec.disk_positions
        from_slot = [
            i for i, p in enumerate(positions) if p in spec.demoting and hashes[i] not in self.disk
        ]
        if not from_slot:
            return self._staged.load(spec.disk, device_ids[positions], ready, guard)
        failed = [
            hashes[i].hex()
            for i in from_slot
            if self._failed_demotions.get(spec.demoting[positions[i]]) == hashes[i]
        ]
        if failed:
            raise BlockLoadError(f"demotion of {failed} failed; their CPU slots were reused")
        slot_set = set(from_slot)
        rest = [i for i in range(len(positions)) if i not in slot_set]
        slots = CPULoadStoreSpec([spec.demoting[positions[i]] for i in from_slot])
        with holding(guard, "a cascade load's blocks being demoted"):
            moved = self._host.load(slots, device_ids[[positions[i] for i in from_slot]], ready)
        if rest:
            sub = DiskLoadStoreSpec(
                [hashes[i] for i in rest], [spec.disk.block_ids[i] for i in rest]
            )
            moved += self._staged.load(sub, device_ids[[positions[i] for i in rest]], ready, guard)
        return moved

    def _demote(self, demotion: Demotion | None) -> None:
        if demotion is None:
            return
        try:
            slots = self.memory.slot_ids(demotion.src)
            self.memory.verify(slots)
            self.disk.write_segments(demotion.dst, self.memory.slot_parts(slots))
        except Exception as exc:  # not this job's blocks: record, and go on
            log.warning("demotion of %d blocks failed: %r", len(demotion.block_hashes), exc)
            with self._lock:
                self._lost.extend(demotion.block_hashes)
                self.failed_demotions += 1
                self.failed_demotion_blocks += len(demotion.block_hashes)
            self._failed_demotions.update(
                zip(demotion.src.block_ids.tolist(), demotion.block_hashes, strict=True)
            )
            return
        for slot in slots.tolist():
            self._failed_demotions.pop(slot, None)
