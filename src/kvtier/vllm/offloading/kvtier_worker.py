"""vLLM's worker-side `OffloadingWorker` over kvtier's transfer workers.

vLLM hands the worker its KV caches as canonical tensors, one `[num_blocks,
page_bytes]` byte view per attention layer (of a hybrid model: per layer of its
largest KV-cache group, which the other groups' layers share), where a block's page is
its K plane then its V plane. Under tensor parallelism each worker holds, and moves,
its own shard (its heads), into tiers of its own (see `engine_shape`). kvtier's data
plane cuts caches into per-block segments in the host
byte order `[layer][K, V][...]`, so each page is cut into its two halves and
everything below (host slots, the crash-safe disk cascade, Redis) is kvtier's own
code, run exactly as the replay tool runs it. CPU tensors on the CPU platform; on
CUDA the same transfer workers use their copy streams, events and pinned memory.

One vLLM job becomes one kvtier job per tier its spec names. The job is done when
every part is; a failed part is recorded in the `WorkerReport` (and, for loads, its
device blocks in `take_load_errors`) for `KvtierConnector` to hand to the scheduler
and to vLLM's recompute path. Under vLLM's own `OffloadingConnector` (no failure
channel) results carry the real success flag.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier.connector.tier_config import TierConfig
from kvtier.offload.cascade_manager import CascadeLoadSpec, CascadeStoreSpec
from kvtier.remote.head_codec import header_size
from kvtier.remote.kv_store import LoadGuard
from kvtier.remote.remote_manager import RemoteLoadStoreSpec
from kvtier.store.disk_store import DiskStore
from kvtier.store.layout import KVLayout
from kvtier.store.memory import MemoryStore
from kvtier.store.shared_disk import SharedDiskStore
from kvtier.transfer.cascade_handler import (
    CascadeHandler,
    CopyThenWrite,
    DiskWrite,
    split_disk_part,
)
from kvtier.transfer.handlers import SlotPieces, StagedHandler, slot_order
from kvtier.transfer.pages import PagedDeviceKV
from kvtier.transfer.transfer_worker import TransferWorker
from kvtier.types import BlockHash
from kvtier.vllm.offloading.engine_shape import HeadSharing
from kvtier.vllm.offloading.job_specs import (
    LOCAL,
    REMOTE,
    KvtierLoadSpec,
    KvtierStoreSpec,
    Part,
    WorkerReport,
)
from kvtier.vllm.offloading.part_queries import (
    cpu_slots,
    detach_demotion,
    medium_of,
    own,
    queued_blocks,
    slots_of,
    subpart,
    timed_blocks,
    writes_after,
    writes_disk,
    writes_disk_in_job,
)

log = logging.getLogger(__name__)
FLUSH_BATCH = 64  # blocks per disk write of the flush at shutdown
# how long a shutdown waits for the disk writes in flight (then for each transfer thread)
# before it goes on without them: a healthy disk ends a full writer queue (64 jobs) in a
# second or two; one that hangs would otherwise keep the engine from ever stopping
SHUTDOWN_WAIT_S = 30.0


@dataclass
class _Job:
    """A vLLM job: its kvtier parts still running, and how it went so far."""

    is_load: bool
    device_ids: npt.NDArray[np.int64]
    promotion: Part | None = None  # written once the remote part has loaded
    waiting: dict[int, Part] = field(default_factory=dict)
    # a store's Redis parts written from the CPU slots a local part fills: by that part
    after: dict[int, list[tuple[int, Part]]] = field(default_factory=dict)
    ok: bool = True
    bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    deadline: float | None = None  # on the worker's clock: when its load parts are given up
    deadline_s: float = 0.0  # how long that was from its submission
    epoch: int = 0  # the scheduler's reset epoch it belongs to


def _ran(job: _Job, began: float) -> float:
    """What a load part given up at its deadline took at least: the deadline less what
    it waited in its tier's queue (`began`, on `time.perf_counter`, as `job.started`).
    The estimate learns that the tier is slow (else a tier never measured would be
    loaded, and given up, every time); a part given up before its tier took it is no
    sample at all: the load ahead of it is. Counted whole, a load that waited behind
    another on a busy engine taught the estimate that the tier itself was slow, and the
    loads after it were declined. Nor does the time past the deadline count: it is the
    step the engine was in when the deadline passed (checked between steps), not the
    tier's: on a saturated engine a step is a whole prefill."""
    return max(job.deadline_s - max(began - job.started, 0.0), 0.0)


def freeze_startup_heap() -> None:
    """Leave the worker process's startup objects (torch's, vLLM's, the model's) out of
    Python's full garbage collections, as vLLM's `freeze_gc_heap` does in its engine core
    process but not in its workers' processes, where kvtier's data plane runs. A job's
    views of the engine's blocks are thousands of GC-tracked objects (a memoryview per
    block and segment), and a full collection they set off there scanned the whole
    heap: 80-100 ms, measured as the first disk load of a restarted worker (96 MiB)
    taking 100 ms instead of 13-16 ms. Objects made later are collected as before;
    those frozen are freed by reference counting, not by the cycle collector."""
    gc.collect()  # what is garbage now is freed, not frozen
    gc.freeze()


def open_disk(
    config: TierConfig,
    root: str | Path,
    layout: KVLayout,
    num_blocks: int,
    sharing: HeadSharing | None,
) -> DiskStore | SharedDiskStore:
    """This worker's disk tier: a directory of its own, or its heads in a shared one."""
    if sharing is None:
        capacity = DiskStore.capacity_for(layout, num_blocks)
        return DiskStore(
            root, layout, capacity, fsync=config.disk_fsync, io_threads=config.disk_io_threads
        )
    shard = sharing.shard
    return SharedDiskStore(
        root,
        sharing.shared,
        layout,
        shard.total,
        shard.group,
        num_blocks * (header_size(shard.count) + layout.bytes_per_block),
        writes=shard.writes,
        fsync=config.disk_fsync,
        io_threads=config.disk_io_threads,
    )


class KvtierOffloadingWorker(OffloadingWorker):
    def __init__(
        self,
        config: TierConfig,
        layout: KVLayout,
        kv_caches: CanonicalKVCaches,
        *,
        num_cpu_slots: int,
        num_disk_blocks: int = 0,
        disk_root: str | Path | None = None,
        remote: Any = None,
        remote_sharing: HeadSharing | None = None,
        disk_sharing: HeadSharing | None = None,
        report_failures: bool = True,
    ) -> None:
        """`disk_root`: this worker's disk root (default `config.disk_path`; one per rank
        under tensor parallelism, see `engine_shape.shard_root`);
        `remote`: a `RemoteTier` opened for `layout` (closed by `shutdown`), or, with
        `remote_sharing`, for the blocks kept by KV head (this worker moves its heads);
        `disk_sharing`: the disk directory is shared by several engines, and this worker
        keeps its heads of each block there (`kvtier.store.shared_disk`);
        `report_failures`: failures go to the report (KvtierConnector) rather than into
        the results, which vLLM's own connector asserts are all successful."""
        self.kv = PagedDeviceKV(layout, [t.tensor for t in kv_caches.tensors])
        self.clock: Callable[[], float] = time.perf_counter  # the loads' deadlines
        self.idle: Callable[[float], None] = time.sleep  # an empty step with nothing here
        self.shutdown_wait_s = SHUTDOWN_WAIT_S
        self._block_bytes = layout.bytes_per_block
        self.memory = MemoryStore(layout, num_cpu_slots, checksums=config.cpu_checksums)
        self.report_failures = report_failures
        self.disk: DiskStore | SharedDiskStore | None = None
        self._handler: CascadeHandler | None = None
        self.remote_tier = remote
        self._remote_writes = True  # False: another worker writes the same heads to Redis
        self.workers: dict[str, TransferWorker] = {}
        # on the CPU platform: `cpu_copy_threads` copying threads (see HostSlotHandler)
        threads = self.kv.torch_threads
        copiers = 1 if self.kv.is_cuda else config.cpu_copy_threads
        try:
            if config.disk_path is not None:
                self.disk = open_disk(
                    config, disk_root or config.disk_path, layout, num_disk_blocks, disk_sharing
                )
                self._handler = CascadeHandler(
                    self.kv, self.memory, self.disk, copy_threads=copiers
                )
                self.workers[LOCAL] = TransferWorker(
                    self._handler, ordered=True, torch_threads=threads, name="local"
                )
            else:
                self.workers[LOCAL] = TransferWorker.for_store(
                    self.kv, self.memory, torch_threads=threads, copy_threads=copiers, name="cpu"
                )
            if remote is not None and remote_sharing is None:
                self.workers[REMOTE] = TransferWorker.for_store(
                    self.kv,
                    remote.kv_store(layout),
                    torch_threads=threads,
                    name="redis",
                    store_threads=config.redis_store_threads,
                )
            elif remote is not None and remote_sharing is not None:
                shard, row = remote_sharing.shard, remote_sharing.row
                by_head = PagedDeviceKV(
                    row, [t.tensor for t in kv_caches.tensors], heads=shard.count
                )
                self.workers[REMOTE] = TransferWorker.for_store(
                    by_head,
                    remote.head_store(row, shard),
                    torch_threads=threads,
                    name="redis",
                    store_threads=config.redis_store_threads,
                )
                self._remote_writes = shard.writes
        except BaseException:
            self.shutdown()
            raise
        self._sub_ids = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self._owner: dict[tuple[str, int], int] = {}  # (tier, kvtier job id) -> vLLM job id
        self._results: list[TransferResult] = []
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._load_errors: set[int] = set()
        self._transfer_log = os.environ.get("KVTIER_TRANSFER_LOG") or None
        # CPU slot -> the block its last store or promotion wrote, for the flush at
        # shutdown; cleared when a job of a later reset epoch arrives
        self._slots: dict[int, BlockHash] = {}
        self._epoch = 0
        self._remote_corrupt = 0  # the remote store's corrupt_blocks already reported
        # each tier's store queue: its bound and the bytes of its stores not done yet
        self._store_cap = {LOCAL: config.store_queue_bytes(True)}
        self._store_cap[REMOTE] = config.store_queue_bytes(False)
        self._store_queued = dict.fromkeys(self._store_cap, 0)
        self._queued_sent = dict(self._store_queued)  # as the last report said
        # parts whose device blocks a flush need not wait for: Redis store parts copied into
        # host memory at submission (`_stage_remote`; a CPU device only, see `snapshot`),
        # and the local tier's disk writes (`_split_writes`)
        self._staged: set[int] = set()
        # set at a reset: the disk writes of the epoch before it that are still queued
        self._writes_void = threading.Event()
        # a disk write of before a reset is still in progress (see `writes_disk_in_job`)
        self._fenced = False
        # the local tier's disk writes run apart from its copies and loads (under
        # KvtierConnector only: see `_split_writes`)
        self._writes_apart = self._handler is not None and report_failures
        # the writes of loads' demotions (no job's: a request waits for its load only)
        self._detached: dict[int, DiskWrite] = {}
        if self._handler is not None and self._writes_apart:
            self._handler.detach_write = self._submit_detached
        # a store's blocks a full CPU tier sends straight to disk are copied into host
        # rows at submission and written apart, on a CPU device (see `snapshot`)
        self._snapshots = self._handler is not None and self.kv.device.type == "cpu"
        handler = self.workers[REMOTE].handler if REMOTE in self.workers else None
        self._stager = (
            handler
            if isinstance(handler, StagedHandler) and handler.kv.device.type == "cpu"
            else None
        )
        # Redis store blocks that the job also puts in the CPU tier are written from
        # there (`SlotPieces`): the slots' segments as they lie, or where Redis keeps
        # blocks by KV head, their runs in head order (`slot_order`)
        self._slot_order = (
            None
            if self._stager is None or remote_sharing is None
            else slot_order(self.kv, self._stager.kv)
        )
        self._from_slots = (
            self._stager is not None
            and (remote_sharing is None or self._slot_order is not None)
            and hasattr(self._stager.medium, "write_pieces")
        )
        freeze_startup_heap()

    # --- submission ----------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._submit(job_id, False, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, True, dst_spec, src_spec)

    def _submit(self, job_id: int, is_load: bool, gpu: GPULoadStoreSpec, spec: Any) -> bool:
        if not isinstance(spec, KvtierStoreSpec | KvtierLoadSpec):
            raise TypeError(f"KvtierOffloadingWorker got a {type(spec).__name__} spec")
        device_ids = np.asarray(gpu.block_ids, dtype=np.int64)
        promotion = getattr(spec, "promotion", None)
        if self._handler is not None and spec.epoch != self._epoch:
            # a reset: what the last epoch's disk writes wrote must be gone before this
            # job's blocks (which may have the same hashes and, after a weight update,
            # other bytes) are written. Those the writer has not begun are void (written
            # by no one); the one in progress deletes what it wrote once it ends, and every
            # disk write of the new epoch runs after it on the writer thread (but those of
            # copy jobs: `writes_disk_in_job`), so nothing waits for the disk. (Before,
            # this job waited for the write in progress, and vLLM's step with it, for as
            # long as a disk that hangs did. Under vLLM's own connector a store's disk
            # writes run in its job, in order, before the discards that follow.)
            self._writes_void.set()
            self._writes_void = threading.Event()
            self._fenced = not self._wait_writes(self._is_disk_write, timeout=0)
        elif self._fenced and self._wait_writes(self._is_disk_write, timeout=0):
            self._fenced = False
        self._note_slots(spec.epoch, spec.parts if promotion is None else [*spec.parts, promotion])
        if spec.discards and self._handler is not None:  # in order, before this job
            self.workers[LOCAL].submit_discard(next(self._sub_ids), spec.discards)
        job = _Job(is_load, device_ids, getattr(spec, "promotion", None), epoch=spec.epoch)
        parts = spec.parts
        if not is_load and not self._remote_writes:  # nothing of its own to write there
            parts = [part for part in parts if part.tier != REMOTE]
        deadline_s = getattr(spec, "deadline_s", None)
        if is_load and deadline_s is not None and self.report_failures:
            job.deadline, job.deadline_s = self.clock() + deadline_s, deadline_s
            parts = [
                own(part, guard=LoadGuard())
                if isinstance(part.spec, RemoteLoadStoreSpec | CascadeLoadSpec)
                else part
                for part in parts
            ]
        if is_load and self._writes_apart:
            parts = [detach_demotion(part) for part in parts]
        # (vLLM's own connector has no way to hear of a shed store: it sheds none)
        if not is_load and self.report_failures:
            parts = self._admit_stores(parts)
        subs = [(next(self._sub_ids), part) for part in parts]
        if not is_load:
            subs = self._split_writes(subs, device_ids)
        if not is_load and self.report_failures:
            subs, job.after = self._stage_remote(subs, device_ids)
        with self._lock:
            self._jobs[job_id] = job
            for sub, part in [*subs, *(d for ds in job.after.values() for d in ds)]:
                job.waiting[sub] = part
                self._owner[part.tier, sub] = job_id
            if not subs:
                self._finish(job_id, job)
        for sub, part in subs:
            worker = self.workers[part.tier]
            ids = device_ids[part.positions]
            if is_load:
                worker.submit_load(sub, part.spec, ids)
            elif isinstance(part.spec, DiskWrite):
                worker.submit_write(sub, part.spec)
            else:
                worker.submit_store(sub, ids, part.spec)
        return True

    def _is_disk_write(self, tier: str, sub: int) -> bool:
        """Whether a job's part is a local disk write run apart (`_split_writes`)."""
        return tier == LOCAL and sub in self._staged

    def _split_writes(
        self, subs: list[tuple[int, Part]], device_ids: npt.NDArray[np.int64]
    ) -> list[tuple[int, Part]]:
        """Each local store part's disk writes as jobs of their own (`DiskWrite`, on the
        worker's writer thread): those of the blocks it also puts in the CPU tier, from
        the CPU slots once its copy is done, and on a CPU device those it sends straight
        to disk (a CPU tier too full to take them), from host rows copied out of the
        engine's blocks now. vLLM's flush of the engine's blocks (`wait`) then waits for
        the copy alone, and later stores' copies never queue behind a slow disk
        (`cascade_handler.split_disk_part`). The writes count in the local store queue
        (the part was admitted whole); the vLLM job is done once all of them are, and
        the copy's blocks are reported readable from the CPU tier as soon as it is
        done (`WorkerReport.copied`, in `_settle`). A store's demotion (`disk_writes:
        demote`) is cut away the same way: the copy job copies the evicted blocks out
        of their slots, and a write takes them to disk (`cascade_handler._split_demotion`).
        Under vLLM's own connector nothing is cut: it sheds no store, and a write refused
        by a full writer queue would fail a job it asserts succeeds."""
        if self._handler is None or not self._writes_apart:
            return subs
        out: list[tuple[int, Part]] = []
        for sub, part in subs:
            split = (
                split_disk_part(part.spec, self._snapshots)
                if part.tier == LOCAL and isinstance(part.spec, CascadeStoreSpec)
                else None
            )
            if split is None:
                out.append((sub, part))
                continue
            writes: list[tuple[DiskWrite, list[int]]] = []
            if split.from_slots is not None:
                writes.append(split.from_slots)
            if split.from_device is not None:
                disk, picked = split.from_device
                rows = self._handler.snapshot(device_ids[[part.positions[i] for i in picked]])
                writes.append((DiskWrite(disk, staged=rows), picked))
            if split.demotion is not None:  # (none of the store's blocks: its own kind)
                writes.append((split.demotion, []))
            pieces = [] if split.copy is None else [dataclasses.replace(part, spec=split.copy)]
            for write, picked in writes:
                write.void = self._writes_void
                positions = [part.positions[i] for i in picked]
                pieces.append(Part(LOCAL, positions, [part.block_hashes[i] for i in picked], write))
            if split.copy is not None:
                out.append((sub, pieces[0]))
            # admitted as one part: each piece leaves the queue when it is done, so the
            # queue holds what the pieces hold over what the part was admitted with
            queued = sum(map(queued_blocks, pieces)) - queued_blocks(part)
            with self._lock:
                for piece in pieces[1 if split.copy is not None else 0 :]:
                    later = next(self._sub_ids)
                    out.append((later, piece))
                    self._staged.add(later)
                if self.report_failures:
                    self._store_queued[LOCAL] += queued * self._block_bytes
        return out

    def _submit_detached(self, write: DiskWrite) -> None:
        """A load's demotion, staged by its job (on the cascade's thread): its write goes
        to the writer thread, no job's part, so the request's load is done without it.
        Loads of its blocks fail until it is (`CascadeHandler._load_disk`); the shutdown
        waits for it like any write. Its host rows count in the local store
        queue as a store's demotion does: past the queue's bound (a disk that falls
        behind) it is shed, its blocks lost from the disk tier, as a store would be."""
        assert write.demotion is not None and self._handler is not None
        write.void = self._writes_void
        nbytes = len(write.demotion.block_hashes) * self._block_bytes
        with self._lock:
            shed = self._behind(LOCAL, nbytes)
            if not shed:
                self._store_queued[LOCAL] += nbytes
                sub = next(self._sub_ids)
                self._detached[sub] = write
        if shed:
            self._handler.drop_demotion(write, shed=True)
            return
        self.workers[LOCAL].submit_write(sub, write)

    def _wait_writes(
        self, waits_for: Callable[[str, int], bool], timeout: float | None = None
    ) -> bool:
        """`_wait` over every job, then for the loads' demotion writes (no job's); False
        if either took past `timeout` seconds."""
        if not self._wait(set(self._jobs), waits_for, timeout):
            return False
        with self._lock:
            detached = list(self._detached)
        return not detached or self.workers[LOCAL].wait(detached, timeout=timeout)

    def _admit_stores(self, parts: list[Part]) -> list[Part]:
        """The store parts their tiers' queues have room for; the others are shed: not
        stored, reported (the scheduler frees their slots and counts them), never an
        error. A tier whose queue is empty takes any job: it is not behind."""
        admitted = []
        # a local part with a disk part or a demotion takes up to three writes
        # (`_split_writes`): with the writer's queue near full (a disk that stalls), it is
        # shed like one past the bound (its demotion with it: those blocks are lost)
        writes_full = self._handler is not None and self.workers[LOCAL].writes_room() < 3
        with self._lock:
            for part in parts:
                nbytes = queued_blocks(part) * self._block_bytes
                behind = part.tier == LOCAL and (
                    (writes_full and writes_disk(part))
                    or (self._fenced and writes_disk_in_job(part, self._snapshots))
                )
                if behind or self._behind(part.tier, nbytes):
                    self._report.shed_stores.setdefault(part.tier, []).extend(part.block_hashes)
                    self._forget_slots(part)
                    demotion = getattr(part.spec, "demotion", None)
                    if demotion is not None:  # never written: the scheduler forgets them
                        self._report.lost_demotions.extend(demotion.block_hashes)
                    continue
                self._store_queued[part.tier] += nbytes
                admitted.append(part)
        return admitted

    def _behind(self, tier: str, nbytes: int) -> bool:
        """Whether a store of `nbytes` would take `tier`'s queue past its bound (under
        the lock): a queue that holds nothing takes any store, it is not behind."""
        queued = self._store_queued[tier]
        return bool(queued) and queued + nbytes > self._store_cap[tier]

    def _stage_remote(
        self, subs: list[tuple[int, Part]], device_ids: npt.NDArray[np.int64]
    ) -> tuple[list[tuple[int, Part]], dict[int, list[tuple[int, Part]]]]:
        """Free the engine's blocks of each Redis store part from a slow Redis (vLLM's
        flush, `wait`, need not wait for it): the blocks that the job's local part also
        writes into CPU slots are written to Redis from those slots once that part is
        done (returned by local part, to submit then); the others are copied into host
        memory now. The copies are what the Redis store queue counts: at most its bound
        in all (a part larger than the whole bound is sent from the engine's blocks)."""
        if self._stager is None:
            return subs, {}
        in_cpu = cpu_slots(subs) if self._from_slots else {}
        staged: list[tuple[int, Part]] = []
        after: dict[int, list[tuple[int, Part]]] = {}
        for sub, part in subs:
            nbytes = len(part.positions) * self._block_bytes
            if not isinstance(part.spec, RemoteLoadStoreSpec) or nbytes > self._store_cap[REMOTE]:
                staged.append((sub, part))
                continue
            by_local: dict[int, list[int]] = {}
            rest = []
            for i, position in enumerate(part.positions):
                if position in in_cpu:
                    by_local.setdefault(in_cpu[position][0], []).append(i)
                else:
                    rest.append(i)
            for local, picked in by_local.items():
                slots = np.array([in_cpu[part.positions[i]][1] for i in picked], dtype=np.int64)
                pieces = SlotPieces(self.memory, slots, self._slot_order)
                piece = own(subpart(part, picked), staged=pieces)
                after.setdefault(local, []).append((next(self._sub_ids), piece))
            if rest:
                piece = part if len(rest) == len(part.positions) else subpart(part, rest)
                snapshot = self._stager.snapshot(device_ids[piece.positions])
                staged.append((copied := next(self._sub_ids), own(piece, staged=snapshot)))
                self._staged.add(copied)
        self._staged.update(sub for parts in after.values() for sub, _ in parts)
        return staged, after

    # --- results -------------------------------------------------------------

    def get_finished(self) -> list[TransferResult]:
        # finished loads first: one that finished during a long step, past its deadline,
        # has its blocks in place (giving it up would recompute them for nothing)
        self._poll()
        self._expire_loads()
        if self.disk is not None:
            corrupt = self.disk.take_dropped()
            lost = self._handler.take_lost() if self._handler is not None else []
            with self._lock:
                self._report.corrupt_blocks += corrupt
                self._report.lost_demotions += lost
        if self.remote_tier is not None:
            refused = self.remote_tier.stats.corrupt_blocks
            with self._lock:
                self._report.remote_corrupt += refused - self._remote_corrupt
                self._remote_corrupt = refused
        with self._lock:
            results, self._results = self._results, []
        return results

    def _expire_loads(self) -> None:
        """Give up the parts of loads past their deadline (a Redis that stopped answering,
        a disk read that hangs, or CPU copies queued behind one in the cascade's worker):
        their blocks are reported failed (vLLM recomputes them) and not one byte of a
        late answer reaches them (the parts' guards)."""
        now = self.clock()
        with self._lock:
            expired = [
                (sub, part, job)
                for job in self._jobs.values()
                if job.deadline is not None and now > job.deadline
                for sub, part in job.waiting.items()
                if part is not job.promotion and getattr(part.spec, "guard", None) is not None
            ]
        for sub, part, job in expired:
            part.spec.guard.abandon()  # type: ignore[attr-defined]
            began = self.workers[part.tier].began(sub)
            tier = medium_of(part)
            with self._lock:
                expired_blocks = self._report.expired_loads
                expired_blocks[tier] = expired_blocks.get(tier, 0) + len(part.block_hashes)
                if began is not None:
                    self._report.loads.append((tier, timed_blocks(part), _ran(job, began)))
            log.warning(
                "kvtier: a %s load of %d blocks passed its deadline; vLLM recomputes them",
                tier,
                len(part.block_hashes),
            )
            self._settle(part.tier, sub, False, 0)

    def _poll(self) -> None:
        for tier, worker in list(self.workers.items()):
            for result in worker.get_finished():
                self._log_transfer(tier, result.job_id, result.ok, result.bytes, result.seconds)
                self._settle(tier, result.job_id, result.ok, result.bytes, result.seconds)

    def _log_transfer(self, tier: str, sub: int, ok: bool, nbytes: int, seconds: float) -> None:
        """One JSON line per tier job to `$KVTIER_TRANSFER_LOG`, when set: each copy's own
        bytes and seconds (vLLM's metrics see whole jobs, queueing included, and round
        their time counters to whole seconds)."""
        if self._transfer_log is None:
            return
        with self._lock:
            job_id = self._owner.get((tier, sub))
            job = self._jobs.get(job_id) if job_id is not None else None
        if job is None:
            return  # a discard job
        direction = "load" if job.is_load and job.waiting.get(sub) is not job.promotion else "store"
        line = {"tier": tier, "direction": direction, "ok": ok, "bytes": nbytes, "s": seconds}
        with open(self._transfer_log, "a") as log_file:
            log_file.write(json.dumps(line) + "\n")

    def _settle(self, tier: str, sub: int, ok: bool, nbytes: int, seconds: float = 0.0) -> None:
        promote: tuple[int, Part, npt.NDArray[np.int64]] | None = None
        with self._lock:
            job_id = self._owner.pop((tier, sub), None)
            if job_id is None:  # a discard job, or a load's demotion written apart
                detached = self._detached.pop(sub, None) if tier == LOCAL else None
                if detached is not None and detached.demotion is not None:
                    self._dequeue(LOCAL, len(detached.demotion.block_hashes))
                if detached is not None and not ok and self._handler is not None:
                    self._handler.drop_demotion(detached)  # refused: never written
                return
            job = self._jobs[job_id]
            part = job.waiting.pop(sub)
            self._staged.discard(sub)
            writes = writes_after(part.spec)
            if writes and not ok:  # (a copy refused unrun): its writes fail
                for write in writes:
                    write.copy.settle(False)
            elif writes and job.waiting:  # its writes go on: the CPU tier serves the blocks
                assert isinstance(part.spec, CopyThenWrite)  # (what `writes` came from)
                in_cpu = [part.block_hashes[i] for i in part.spec.cpu_positions]
                self._report.copied.extend((job.epoch, h) for h in in_cpu)
            if not job.is_load and self.report_failures:  # its room in the queue is free
                self._dequeue(part.tier, queued_blocks(part))
            job.bytes += nbytes
            direction = "load" if job.is_load and part is not job.promotion else "store"
            timed = f"{medium_of(part)}:{direction}"
            self._report.seconds[timed] = self._report.seconds.get(timed, 0.0) + seconds
            if ok and direction == "load":
                self._report.loads.append((medium_of(part), timed_blocks(part), seconds))
            loaded_remote = job.is_load and tier == REMOTE
            if not ok:  # the slots it wrote (a store, a promotion) hold nothing to flush
                self._forget_slots(part)
                if loaded_remote and job.promotion is not None:
                    self._forget_slots(job.promotion)
            if not ok and job.is_load and part is not job.promotion:
                job.ok = False
                self._report.failed_loads.append(part.block_hashes)
                self._load_errors.update(int(i) for i in job.device_ids[part.positions])
            elif not ok and isinstance(part.spec, DiskWrite) and part.spec.demotion is not None:
                # a demotion's write refused unrun (its blocks are not the job's): lost
                self._report.lost_demotions.extend(part.spec.demotion.block_hashes)
            elif not ok:  # a store, or a promotion (its load went fine: not a failed load)
                job.ok = job.ok and job.is_load
                self._report.failed_stores.setdefault(part.tier, []).extend(part.block_hashes)
            follow = job.after.pop(sub, [])
            if follow and not ok:  # the Redis parts to write from its slots: not stored
                for late, late_part in follow:
                    del job.waiting[late], self._owner[REMOTE, late]
                    self._staged.discard(late)
                    self._dequeue(REMOTE, queued_blocks(late_part))
                    failed = self._report.failed_stores.setdefault(REMOTE, [])
                    failed.extend(late_part.block_hashes)
                follow = []
            device_ids = job.device_ids
            if loaded_remote and job.promotion is not None:
                if ok:  # the device now holds the blocks: copy them into their local slots
                    promote = (next(self._sub_ids), job.promotion, job.device_ids)
                    job.waiting[promote[0]] = job.promotion
                    self._owner[LOCAL, promote[0]] = job_id
                else:
                    failed = self._report.failed_stores.setdefault(LOCAL, [])
                    failed.extend(job.promotion.block_hashes)
            if not job.waiting:
                self._finish(job_id, job)
        if promote is not None:
            sub, promotion, device_ids = promote
            self.workers[LOCAL].submit_store(sub, device_ids[promotion.positions], promotion.spec)
        for late, late_part in follow:  # the CPU slots hold the blocks now (not read there)
            self.workers[REMOTE].submit_store(late, device_ids[late_part.positions], late_part.spec)

    def _dequeue(self, tier: str, blocks: int) -> None:
        """The room of a store's `blocks` in `tier`'s queue is free (under the lock)."""
        queued = self._store_queued[tier] - blocks * self._block_bytes
        self._store_queued[tier] = max(queued, 0)

    def _finish(self, job_id: int, job: _Job) -> None:
        del self._jobs[job_id]
        success = job.ok or self.report_failures
        seconds = time.perf_counter() - job.started
        self._results.append(TransferResult(job_id, success, job.bytes, seconds))

    # --- the CPU tier's blocks, for the flush at shutdown ----------------------

    def _note_slots(self, epoch: int, parts: list[Part]) -> None:
        """Record which block each CPU slot of the cascade receives. A job of a later
        reset epoch first forgets them all: a reset let those slots go."""
        if self._handler is None:
            return  # no disk tier: nothing to flush to
        with self._lock:
            if epoch != self._epoch:
                self._slots.clear()
                self._epoch = epoch
            for part in parts:
                self._slots.update(slots_of(part))

    def _forget_slots(self, part: Part) -> None:
        """A store or promotion failed: its slots' bytes are not the blocks'."""
        for slot, block_hash in slots_of(part):
            if self._slots.get(slot) == block_hash:
                del self._slots[slot]

    def flush_to_disk(self) -> int:
        """Write every block of the CPU tier not yet on disk to the disk tier; returns
        how many. Run at a clean shutdown, after every job is done: with `demote` the
        CPU tier's blocks reach disk only when evicted, and a restart must find them.
        Stops, with a warning, when the disk tier is full (it is never written above
        its budget). Blocks this worker never saw completed are not written."""
        if self.disk is None or not self.workers:
            return 0
        # the disk writes too (a block written twice at once would share a temp file)
        every_write = lambda tier, sub: tier == LOCAL or sub not in self._staged  # noqa: E731
        if not self._wait_writes(every_write, timeout=self.shutdown_wait_s):
            log.warning(
                "kvtier: disk writes still in flight after %.0f s at shutdown (a disk that "
                "hangs): the CPU tier is not flushed; a restart finds what reached the disk",
                self.shutdown_wait_s,
            )
            return 0
        with self._lock:
            pending = [(s, h) for s, h in self._slots.items() if h not in self.disk]
        written = 0
        for first in range(0, len(pending), FLUSH_BATCH):
            batch = pending[first : first + FLUSH_BATCH]
            slots = [slot for slot, _ in batch]
            try:
                self.disk.write_parts([h for _, h in batch], self.memory.slot_parts(slots))
            except OSError as exc:
                log.warning("kvtier: flush at shutdown stopped after %d blocks: %s", written, exc)
                break
            written += len(batch)
        if pending:
            log.info("kvtier: flushed %d CPU-tier blocks to disk at shutdown", written)
        return written

    def take_report(self) -> WorkerReport:
        with self._lock:
            report, self._report = self._report, WorkerReport()
            queued = dict(self._store_queued)
        if any(queued.values()) or queued != self._queued_sent:
            report.queued_bytes = queued  # (the `store_queue_bytes` gauge)
            self._queued_sent = queued
        return report

    def note_step(self, num_tokens: int, seconds: float) -> None:
        """An engine step that computed `num_tokens` tokens (the recompute estimate)."""
        with self._lock:
            self._report.steps.append((num_tokens, seconds))

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_transfer(self, timeout: float, others: bool = False) -> None:
        """Block until the oldest load in flight is done (with no load: the oldest store),
        or `timeout` seconds pass; with none in flight here, return at once, or, when
        `others` (another worker of the engine still runs its part of a job), idle for
        `timeout` seconds.

        Why stores too: an engine whose requests have all finished while their stores are
        in flight keeps stepping, empty, until the stores complete, and each empty step
        runs the engine and every worker. Measured on a tensor-parallel CPU engine after
        its last prompt: its three processes' main threads took 9.9 of the 11.6
        core-seconds of 5.8 s, kvtier's transfer threads (bound to the workers' cores)
        0.04-0.07 s each and the Redis server next to none, so a worker's 50 MB Redis
        store took 5.7 s, or failed at the 5 s socket timeout (15.6 s in all), and the
        next engine found part of the prompt in Redis (issue 33). With this wait the same
        stores took 0.6 s."""
        with self._lock:
            jobs = list(self._jobs.values())
            job = next((j for j in jobs if j.is_load), None) or next(iter(jobs), None)
            subs = [] if job is None else [(part.tier, sub) for sub, part in job.waiting.items()]
        if not subs and others:
            self.idle(timeout)
            return
        deadline = time.monotonic() + timeout
        for tier, sub in subs:
            left = deadline - time.monotonic()
            if left <= 0 or not self.workers[tier].wait([sub], timeout=left):
                return

    def wait(self, job_ids: set[int]) -> None:
        """Block until the engine's blocks of these jobs are free to reuse (vLLM's flush
        before it reallocates them): every part is done (a promotion starts only after
        its load) but those that no longer read them: the Redis stores already copied
        into host memory, and the disk writes from CPU slots (`_split_writes`), which
        finish on their own and complete their jobs later."""
        self._wait(job_ids, lambda tier, sub: sub not in self._staged)

    def wait_finished(self, job_ids: set[int]) -> None:
        """Block until these jobs are done, every part (their results are then in
        `get_finished`)."""
        self._wait(job_ids, lambda tier, sub: True)

    def _wait(
        self,
        job_ids: set[int],
        waits_for: Callable[[str, int], bool],
        timeout: float | None = None,
    ) -> bool:
        """Until no part of these jobs that `waits_for(tier, sub)` (asked under the lock)
        is left; False if `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                subs = {
                    (part.tier, sub)
                    for job_id in job_ids
                    if (job := self._jobs.get(job_id)) is not None
                    for sub, part in job.waiting.items()
                    if waits_for(part.tier, sub)
                }
            if not subs:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False  # (asked here too: with its workers closed, none is waited on)
            for tier, worker in self.workers.items():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                worker.wait([sub for t, sub in subs if t == tier], timeout=left)
            self._poll()

    def shutdown(self) -> None:
        """A clean shutdown: the CPU tier is flushed to disk first (see flush_to_disk)."""
        try:
            self.flush_to_disk()
        except Exception:  # never keep the engine from shutting down
            log.exception("kvtier: flush of the CPU tier at shutdown failed")
        for worker in self.workers.values():
            worker.close(timeout=self.shutdown_wait_s)
        self.workers = {}
        if self.disk is not None:
            self.disk.close()
        if self.remote_tier is not None:
            self.remote_tier.close()
            self.remote_tier = None
