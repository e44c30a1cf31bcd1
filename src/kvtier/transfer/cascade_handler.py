"""The data plane of the CPU -> disk cascade: one job runs everything its spec lists.

Order inside a job is fixed here: a demotion reads CPU slots the same job is about
to overwrite, so it runs first (or, cut away from a store, copies them into host rows
first, for a write apart: `_split_demotion`); write-through disk copies are taken from
the CPU slots just written (no second device read); a promotion copies freshly loaded
device blocks into their new CPU slots after the load. Any failure fails the job,
except a demotion's: the evicted blocks are not the job's, so a failed demotion
is recorded (`take_lost`) for the scheduler to forget, and the job goes on.

Jobs must run in submission order across directions (`TransferWorker(...,
ordered=True)`, which `worker()` builds): a block being demoted is read from its old
CPU slot by any load submitted before the job that overwrites that slot, and from
disk by any load submitted after it. The exceptions: a load that only reads ready
blocks (`load_may_pass`) goes ahead of queued stores, so a CPU hit never waits for
the disk writes queued before it; and a store's write-through runs as a job of its own
(`split_disk_part`: the store's copy into its CPU slots, then a `DiskWrite` of those
slots to disk, `TransferWorker.submit_write`) on the worker's writer thread, which
waits for that copy and for nothing else; so do, on a CPU device, the blocks that a
CPU tier too full to take them sends straight to disk, copied out of the engine's
blocks into host rows when the store is submitted (as a slow Redis's are). vLLM waits
for a store's copy out of the engine's blocks before it reuses them (its flush), and
with the write-through in the same job, on the same thread as every later copy, it
waited for the disk: with 20 ms a block file, an engine served 0.13x vLLM alone's
requests/s. A write depends on no other job of its reset epoch: its blocks' store is
in flight, so they are neither evicted, discarded nor stored again, nor loaded but from
their CPU slots once the copy is done (a read: `CascadeOffloadingManager.complete_copy`),
and their CPU slots are handed to no other store until it completes. At a reset the
worker waits for the write in progress before the first job of the next epoch, whose
discards delete what it wrote; the writes not begun are void (`DiskWrite.void`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
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
# the longest a write waits for its copy, which was submitted before it: only a copy that
# never ran and was never reported (a bug) keeps it that long
COPY_WAIT_S = 60.0


class CopyOutcome:
    """How the copy a `DiskWrite` writes out went: `done` once it ended (or was given up
    without running), `ok` if it filled the slots."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False

    def settle(self, ok: bool) -> None:
        self.ok = self.ok or ok
        self.done.set()


@dataclass
class DiskWrite(LoadStoreSpec):
    """Write blocks to disk `disk` apart from the engine's blocks (a store's disk part):
    from the CPU slots `slots` once the copy that fills them has (`copy`: a write whose
    copy failed writes nothing, the slots holding other bytes), or from `staged`, host
    rows copied out of the engine's blocks when the store was submitted."""

    disk: LoadStoreSpec
    slots: CPULoadStoreSpec | None = None
    staged: Any = None
    copy: CopyOutcome = field(default_factory=CopyOutcome, compare=False, repr=False)
    # set once the write is void (its store's reset epoch is over): not written, and not
    # failed, when the writer comes to it
    void: threading.Event | None = field(default=None, compare=False, repr=False)
    # a demotion written apart (a store's, `split_disk_part`; a load's promotion's,
    # `CascadeHandler.detach_write`), from `rows`: the evicted blocks copied out of
    # their CPU slots by the job, before it overwrote them
    demotion: Demotion | None = None
    rows: list[bytes] | None = field(default=None, compare=False, repr=False)
    staging_failed: bool = False  # (recorded as a failed demotion by the job)

    @staticmethod
    def medium() -> str:
        return "CASCADE"


@dataclass
class CopyThenWrite(CascadeStoreSpec):
    """The store of a split disk part: its copy into the CPU slots (and any demotion, and
    any disk part still read from the engine's blocks), then `then`."""

    then: DiskWrite | None = None
    demotion_write: DiskWrite | None = None  # its demotion's (the spec's `demotion` None)


@dataclass(frozen=True)
class WriteSplit:
    """A store spec as `split_disk_part` cuts it (positions index the store's blocks)."""

    copy: CopyThenWrite | None  # None: nothing left to run but the writes
    from_slots: tuple[DiskWrite, list[int]] | None  # written from the copy's CPU slots
    from_device: tuple[DiskLoadStoreSpec, list[int]] | None  # for the caller to snapshot
    demotion: DiskWrite | None = None  # the demotion's, from rows the copy job takes


def split_disk_part(spec: CascadeStoreSpec, device_apart: bool) -> WriteSplit | None:
    """The store's disk part cut away from its copy: the blocks it also puts in CPU slots
    as a write from those slots (the write-through), and, with `device_apart`, the others
    (a CPU tier too full to take them) for the caller to copy out of the engine's blocks
    and write apart; None where there is no disk part to cut."""
    if spec.disk is None or not spec.disk_positions:
        if spec.demotion is None:
            return None
        return _split_demotion(spec)
    cpu_positions = spec.cpu_positions if spec.cpu is not None else []
    in_cpu = {p: i for i, p in enumerate(cpu_positions)}
    mine = [i for i, p in enumerate(spec.disk_positions) if p in in_cpu]
    rest = [i for i, p in enumerate(spec.disk_positions) if p not in in_cpu]
    if rest and not isinstance(spec.disk, DiskLoadStoreSpec):
        return None  # (a disk part that cannot be cut by block)
    if not mine and not (rest and device_apart):
        return None

    def part(picked: list[int]) -> tuple[DiskLoadStoreSpec, list[int]]:
        disk = spec.disk
        assert isinstance(disk, DiskLoadStoreSpec)
        sub = DiskLoadStoreSpec(
            [disk.block_hashes[i] for i in picked], [disk.block_ids[i] for i in picked]
        )
        return sub, [spec.disk_positions[i] for i in picked]

    from_slots = None
    if mine:
        disk, positions = part(mine) if rest else (spec.disk, list(spec.disk_positions))
        assert spec.cpu is not None
        slots = spec.cpu.block_ids[[in_cpu[p] for p in positions]]
        from_slots = (DiskWrite(disk, CPULoadStoreSpec(slots)), positions)
    from_device = part(rest) if rest and device_apart else None
    left = part(rest) if rest and not device_apart else None
    copy = None
    if cpu_positions or spec.demotion is not None or left is not None:
        copy = CopyThenWrite(
            spec.cpu,
            list(cpu_positions),
            None if left is None else left[0],
            [] if left is None else left[1],
            spec.demotion,
            then=None if from_slots is None else from_slots[0],
        )
    return WriteSplit(copy, from_slots, from_device)


def _written_by(write: DiskWrite) -> list[BlockHash]:
    """The blocks a disk write writes."""
    if write.demotion is not None:
        return list(write.demotion.block_hashes)
    if not isinstance(write.disk, DiskLoadStoreSpec):
        raise TypeError(f"a disk write needs a DiskLoadStoreSpec, got {write.disk!r}")
    return list(write.disk.block_hashes)


def _split_demotion(spec: CascadeStoreSpec) -> WriteSplit:
    """A store with a demotion and no disk part of its own (`disk_writes: demote`): its
    copy, after the evicted blocks are copied out of their CPU slots into host rows
    (`CascadeHandler._stage_demotion`), and their write to disk apart. The demotion is
    the store's only disk I/O, and it ran in the copy: with the CPU tier full (an engine's
    normal state) every store's flush waited for a disk write."""
    assert spec.demotion is not None
    outcome = CopyOutcome()
    demotion = DiskWrite(spec.demotion.dst, copy=outcome, demotion=spec.demotion)
    copy = CopyThenWrite(spec.cpu, list(spec.cpu_positions), demotion_write=demotion)
    return WriteSplit(copy, None, None, demotion)


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
        # blocks of demotions copied out of their CPU slots, not yet on disk (by how
        # many such demotions hold them): a load of one meanwhile fails (`_load_disk`)
        self._staged_demotions: Counter[BlockHash] = Counter()
        # where a load's staged demotion goes to be written (the worker submits it to the
        # writer thread, apart from any job): None, and a load's demotion runs in it
        self.detach_write: Callable[[DiskWrite], None] | None = None
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
        try:
            return self._store(device_ids, spec, ready)
        finally:  # a copy that failed (or wrote nothing) lets its write go on, to fail
            if isinstance(spec, CopyThenWrite):
                for write in (spec.then, spec.demotion_write):
                    if write is not None:
                        write.copy.settle(False)  # (no change where it settled already)

    def _store(self, device_ids: npt.NDArray[np.int64], spec: LoadStoreSpec, ready: Any) -> int:
        if not isinstance(spec, CascadeStoreSpec):
            raise TypeError(f"cascade store job needs a CascadeStoreSpec, got {spec!r}")
        if isinstance(spec, CopyThenWrite) and spec.demotion_write is not None:
            self._stage_demotion(spec.demotion_write)
        else:
            self._demote(spec.demotion)
        moved = 0
        if spec.cpu is not None and spec.cpu_positions:
            moved += self._host.store(device_ids[spec.cpu_positions], spec.cpu, ready)
        if isinstance(spec, CopyThenWrite) and spec.then is not None:
            spec.then.copy.settle(True)  # the slots hold the blocks: its write may run
        if spec.disk is not None:
            in_cpu = {p: i for i, p in enumerate(spec.cpu_positions)}
            if spec.cpu is not None and all(p in in_cpu for p in spec.disk_positions):
                slots = self.memory.slot_ids(spec.cpu)[[in_cpu[p] for p in spec.disk_positions]]
                self.disk.write_segments(spec.disk, self.memory.slot_parts(slots))  # write-through
                moved += len(slots) * self.kv.layout.bytes_per_block
            else:
                moved += self._staged.store(device_ids[spec.disk_positions], spec.disk, ready)
        return moved

    def write(self, spec: LoadStoreSpec) -> int:
        """A `DiskWrite` (`TransferWorker.submit_write`): from host rows copied at its
        submission, or from the CPU slots its store's copy filled."""
        if not isinstance(spec, DiskWrite):
            raise TypeError(f"cascade write job needs a DiskWrite, got {spec!r}")
        moved = self._write(spec)
        if moved and spec.void is not None and spec.void.is_set():
            # a reset came while it ran (the worker does not wait for the disk at a
            # reset): what it wrote is of before the reset, and goes (the writer runs
            # one write at a time, so none of after the reset is there yet)
            self.disk.discard(_written_by(spec))
        return moved

    def _write(self, spec: DiskWrite) -> int:
        if spec.demotion is not None:
            return self._write_demotion(spec, spec.demotion)
        if spec.void is not None and spec.void.is_set():
            spec.staged = None  # (its host rows go now)
            return 0
        if spec.staged is not None:
            staged, spec.staged = spec.staged, None  # its memory goes with the write
            staged.write_to(self.disk, spec.disk)
            return len(staged.rows) * self.kv.layout.bytes_per_block
        if spec.slots is None:
            raise ValueError("a DiskWrite needs slots or staged rows")
        if not spec.copy.done.wait(COPY_WAIT_S) or not spec.copy.ok:
            raise RuntimeError("the copy into its CPU slots failed: nothing to write")
        slots = self.memory.slot_ids(spec.slots)
        self.disk.write_segments(spec.disk, self.memory.slot_parts(slots))
        return len(slots) * self.kv.layout.bytes_per_block

    def snapshot(self, device_ids: npt.NDArray[np.int64]) -> Any:
        """The engine's blocks copied into host rows now, for a `DiskWrite` (a CPU device
        only: `StagedHandler.snapshot`)."""
        return self._staged.snapshot(device_ids)

    def load(
        self, spec: LoadStoreSpec, device_ids: npt.NDArray[np.int64], ready: Any = None
    ) -> int:
        if not isinstance(spec, CascadeLoadSpec):
            raise TypeError(f"cascade load job needs a CascadeLoadSpec, got {spec!r}")
        write: DiskWrite | None = spec.demotion_write
        if write is not None and self.detach_write is not None:
            # the promotion's room: its blocks copied out of their slots, written apart
            # (the request waits for its load, not for the disk)
            if self._stage_demotion(write):
                self.detach_write(write)
        else:
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
        if self._staged_demotions:
            # copied out of a slot a later job has overwritten, and not on disk yet
            # (`_stage_demotion`; a load's demotion outlives its job): asked before the
            # disk, which has them once they are not
            with self._lock:
                staged = [h.hex() for h in hashes if h in self._staged_demotions]
            if staged:
                raise BlockLoadError(f"{staged} are being demoted: their slots are reused")
        from_slot = [
            i for i, p in enumerate(positions) if p in spec.demoting and hashes[i] not in self.disk
        ]
        if not from_slot:
            return self._staged.load(spec.disk, device_ids[positions], ready, guard)
        with self._lock:
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
            self.disk.write_segments(demotion.dst, self._evicted_parts(demotion))
        except Exception as exc:  # not this job's blocks: record, and go on
            self._demotion_failed(demotion, exc)
            return
        self._demotion_done(demotion)

    def _evicted_parts(self, demotion: Demotion) -> list[list[memoryview]]:
        """The demoted blocks' segments in their CPU slots, checked (`MemoryStore.verify`)."""
        slots = self.memory.slot_ids(demotion.src)
        self.memory.verify(slots)
        return self.memory.slot_parts(slots)

    def _demotion_failed(
        self, demotion: Demotion, exc: BaseException, *, quiet: bool = False
    ) -> None:
        """Record a demotion that never reached the disk: the scheduler forgets its blocks
        (`take_lost`), and a load still naming their old slots fails (`_load_disk`).
        `quiet`: a demotion shed by design (counted, as a shed store is, not a fault)."""
        level = logging.DEBUG if quiet else logging.WARNING
        log.log(level, "demotion of %d blocks failed: %r", len(demotion.block_hashes), exc)
        with self._lock:
            self._lost.extend(demotion.block_hashes)
            self.failed_demotions += 1
            self.failed_demotion_blocks += len(demotion.block_hashes)
            self._failed_demotions.update(
                zip(demotion.src.block_ids.tolist(), demotion.block_hashes, strict=True)
            )

    def _demotion_done(self, demotion: Demotion) -> None:
        with self._lock:
            for slot in demotion.src.block_ids.tolist():
                self._failed_demotions.pop(slot, None)

    def _stage_demotion(self, write: DiskWrite) -> bool:
        """A demotion whose write runs apart (a store's, `_split_demotion`; a load's
        promotion's, `detach_write`): the evicted blocks copied out of their CPU slots
        now, in the job, before it overwrites them; the write takes them to disk
        (`_write_demotion`). Whether they were (a failure is recorded here)."""
        demotion = write.demotion
        assert demotion is not None
        try:
            rows = [b"".join(parts) for parts in self._evicted_parts(demotion)]
        except Exception as exc:  # not this job's blocks: record, and go on
            write.staging_failed = True
            self._demotion_failed(demotion, exc)
            return False
        with self._lock:
            self._staged_demotions.update(demotion.block_hashes)
        write.rows = rows
        write.copy.settle(True)  # the write may go (the job goes on)
        return True

    def drop_demotion(self, write: DiskWrite, *, shed: bool = False) -> None:
        """A staged demotion whose write never runs (refused by a full writer queue, or
        `shed` by a full store queue): a failed demotion, its blocks no longer staged."""
        assert write.demotion is not None
        if write.rows is not None:
            write.rows = None
            why = "shed: the disk tier's store queue is full" if shed else "its write was refused"
            self._demotion_failed(write.demotion, RuntimeError(why), quiet=shed)
            self._unstage(write.demotion)

    def _unstage(self, demotion: Demotion) -> None:
        with self._lock:  # (a Counter's -= keeps only the counts still above 0)
            self._staged_demotions -= Counter(demotion.block_hashes)

    def _write_demotion(self, write: DiskWrite, demotion: Demotion) -> int:
        """The disk write of a staged demotion: never a failure of its job (the blocks
        are not the job's); one that fails, or whose store's job never staged it, is
        recorded as a failed demotion before its blocks stop counting as staged, so no
        load reads the slot they left."""
        if not write.copy.done.wait(COPY_WAIT_S):
            write.copy.settle(False)
        rows, write.rows = write.rows, None
        if rows is None:  # staging failed (recorded), or the store's job never ran
            if not write.staging_failed:
                self._demotion_failed(demotion, RuntimeError("its store's job never ran"))
            return 0
        try:
            if write.void is None or not write.void.is_set():
                self.disk.write_segments(demotion.dst, [[memoryview(row)] for row in rows])
        except Exception as exc:
            self._demotion_failed(demotion, exc)
        else:
            self._demotion_done(demotion)
        finally:
            self._unstage(demotion)
        return len(rows) * self.kv.layout.bytes_per_block
