"""How one job's bytes move, per kind of medium; the worker supplies threads and order.

- `HostSlotHandler`: the memory tier. Device blocks are copied straight into (and
  out of) the store's segment-major slots: no staging, one contiguous copy per run of
  consecutive ids and segment, or one gather/scatter per segment for shuffled ids.
- `StagedHandler`: any `BlockStore` (disk, Redis). Device blocks are gathered into
  contiguous host rows, which the store writes; loads go the other way. On a CPU
  device with the cross-layer layout a block already is one contiguous row, so the
  store reads and writes the engine's memory directly (zero copies).

A handler method raises on failure; the worker turns that into a failed job.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.offload.mediums import BlockIDsLoadStoreSpec
from kvtier.store.layout import KVLayout
from kvtier.store.memory import MemoryStore, block_segments, host_buffer
from kvtier.store.protocol import BlockStore, Guard, holding
from kvtier.transfer.cuda_copy import HostSide, KernelCopier, prefer_kernel
from kvtier.transfer.device import (
    DeviceKV,
    copy_blocks,
    cuda_event,
    cuda_stream,
    float_copy_thread,
    on_stream,
    stack_planes,
)

# written-out snapshots kept for the next ones (`StagedHandler.snapshot`), the oldest
# dropped first: at most this many host bytes (a few requests' worth of the serving
# model's blocks: a 32-block snapshot is 8 MiB) and this many snapshots
SNAPSHOT_POOL_BYTES = 64 << 20
SNAPSHOT_POOL_COUNT = 16


class TransferHandler(Protocol):
    """What the worker calls; `ready_event` runs on the submitting thread, and a job's
    copies wait for what it returns (see `Streams`)."""

    kv: DeviceKV

    def ready_event(self) -> Any: ...

    def store(self, device_ids: npt.NDArray[np.int64], spec: LoadStoreSpec, ready: Any) -> int: ...

    def load(
        self, spec: LoadStoreSpec, device_ids: npt.NDArray[np.int64], ready: Any = None
    ) -> int: ...


class Streams:
    """One CUDA copy stream per direction, so stores and loads overlap.

    The orderings that keep bytes right: a job's copy waits on the event the engine's
    compute stream recorded when the job was submitted (a store: the kernels that wrote
    its blocks come first; a load: whatever the engine still had queued on its
    destination blocks, such as their zeroing or the last reads of their previous
    request, as vLLM's own worker orders its loads), and a copy is reported only once
    its own event has completed (the engine reads a loaded block, or a tier reads a
    stored one, only after the bytes are there). `tests/gpu/test_ordering.py` fails if
    any of them is removed.
    """

    def __init__(self, kv: DeviceKV) -> None:
        self.kv = kv
        self.store = cuda_stream(kv.device) if kv.is_cuda else None
        self.load = cuda_stream(kv.device) if kv.is_cuda else None

    def run(self, stream: Any, ready: Any, copy: Callable[[], int]) -> int:
        """Run `copy` on `stream` after `ready`, and return once the copy has finished."""
        if stream is None:
            return copy()
        with on_stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            moved = copy()
            done = cuda_event()
            done.record(stream)
        done.synchronize()
        return moved


class HostSlotHandler:
    """Device <-> memory-tier slots, copied directly.

    `copy_threads` (CPU devices): a job's segments are split, a layer's K and V
    together, between the calling thread and `copy_threads - 1` helper threads, each
    copying on one torch thread from any core. Inside a vLLM engine on the CPU the
    worker's threads are bound one per core, and the transfer thread (started by a
    bound one) shares its core, so one copying thread gets about one core's bandwidth
    (8 GB/s here, where a plain copy on two threads gets 15-16).
    """

    def __init__(self, kv: DeviceKV, store: MemoryStore, *, copy_threads: int = 1) -> None:
        store.layout.check_compatible(kv.layout.fingerprint, "the memory store")
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        self.kv = kv
        self.host = store
        self._streams = Streams(kv)
        self._host_segments = store.segments()
        self._host_arrays = None if kv.is_cuda else store.segment_arrays()
        # on a GPU: one kernel straight into the pinned slots, where it beats the DMAs
        self._kernel = KernelCopier.for_device(kv) if store.buffer.is_pinned() else None
        if self._kernel is not None:
            seg = kv.layout.segment_bytes
            self._host_side = self._kernel.host_side(store.buffer, seg, store.num_slots * seg)
        # strided segments (vLLM's pages cut in K and V halves) have no DMA of their own:
        # torch copies them through a device buffer in series (0.75-0.86 of the link)
        self._kernel_always = any(not seg.is_contiguous() for seg in kv.segments)
        self._stacks = {
            "store": stack_planes(kv.segments, self._host_segments),
            "load": stack_planes(self._host_segments, kv.segments),
        }
        self._helpers: ThreadPoolExecutor | None = None
        self._shares: list[slice] = [slice(None)]
        if copy_threads > 1 and not kv.is_cuda:
            self._shares = _shares(len(kv.segments), copy_threads)
        if len(self._shares) > 1:
            self._helpers = ThreadPoolExecutor(
                len(self._shares) - 1, "kvtier-copy", initializer=float_copy_thread
            )
            self._share_stacks = {
                direction: [stack_planes(src[share], dst[share]) for share in self._shares]
                for direction, (src, dst) in (
                    ("store", (kv.segments, self._host_segments)),
                    ("load", (self._host_segments, kv.segments)),
                )
            }

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

    def _copy(self, direction: str, src_ids: Any, dst_ids: Any) -> int:
        """`copy_blocks` in `direction`, its segments shared among the copy threads (on a
        GPU: one kernel instead, where it beats one DMA per segment and run)."""
        kernel = self._kernel
        if kernel is not None and (
            self._kernel_always
            or prefer_kernel(
                src_ids, dst_ids, len(self.kv.segments), self.kv.layout.bytes_per_block
            )
        ):
            if direction == "store":
                return kernel.to_host(src_ids, self._host_side, dst_ids)
            return kernel.from_host(self._host_side, src_ids, dst_ids)
        kv_side = (self.kv.segments, self.kv.arrays or None)
        host_side = (self._host_segments, self._host_arrays)
        (src, src_arrays), (dst, dst_arrays) = (
            (kv_side, host_side) if direction == "store" else (host_side, kv_side)
        )
        if self._helpers is None:
            return copy_blocks(
                src,
                src_ids,
                dst,
                dst_ids,
                src_arrays=src_arrays,
                dst_arrays=dst_arrays,
                stacks=self._stacks[direction],
            )
        assert src_arrays is not None and dst_arrays is not None  # CPU only
        jobs = [
            functools.partial(
                copy_blocks,
                src[share],
                src_ids,
                dst[share],
                dst_ids,
                src_arrays=src_arrays[share],
                dst_arrays=dst_arrays[share],
                stacks=stacks,
            )
            for share, stacks in zip(self._shares, self._share_stacks[direction], strict=True)
        ]
        futures = [self._helpers.submit(job) for job in jobs[1:]]
        try:
            moved = jobs[0]()
        finally:  # never report a job while a helper may still write its blocks
            wait_all(futures)
        return moved + sum(future.result() for future in futures)

    def ready_event(self) -> Any:
        return self.kv.record_compute()

    def merge(self, specs: Sequence[LoadStoreSpec]) -> LoadStoreSpec | None:
        """Several jobs' slot specs as one (the worker runs queued jobs as one copy), or
        None if a slot repeats (two jobs on one slot must keep their order) or the
        store verifies checksums: a corrupt slot would fail the merged load, and be
        found (and counted) again when its jobs then run one by one."""
        first = specs[0]
        if self.host.checksums or not isinstance(first, BlockIDsLoadStoreSpec):
            return None
        ids = np.concatenate([self.host.slot_ids(spec) for spec in specs])
        if len(np.unique(ids)) != len(ids):
            return None
        return type(first).of_array(ids)

    def store(self, device_ids: npt.NDArray[np.int64], spec: LoadStoreSpec, ready: Any) -> int:
        slots = self.host.slot_ids(spec)
        moved = self._streams.run(
            self._streams.store, ready, lambda: self._copy("store", device_ids, slots)
        )
        self.host.seal(slots)
        return moved

    def load(
        self, spec: LoadStoreSpec, device_ids: npt.NDArray[np.int64], ready: Any = None
    ) -> int:
        slots = self.host.slot_ids(spec)
        self.host.verify(slots)
        return self._streams.run(
            self._streams.load, ready, lambda: self._copy("load", slots, device_ids)
        )


def _shares(num_segments: int, threads: int) -> list[slice]:
    """`num_segments` cut into at most `threads` slices of whole layers (K and V pairs)."""
    pairs = num_segments // 2 if num_segments % 2 == 0 else num_segments
    per = 2 if num_segments % 2 == 0 else 1
    count = max(1, min(threads, pairs))
    bounds = [round(i * pairs / count) * per for i in range(count + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds) if b > a]


class StagedHandler:
    """Device <-> any `BlockStore`, through contiguous host rows or, on a CPU device,
    straight from the engine's memory (whole rows, or segments if the store takes them)."""

    def __init__(self, kv: DeviceKV, store: BlockStore) -> None:
        store.layout.check_compatible(kv.layout.fingerprint, "the block store")
        self.kv = kv
        self.medium = store
        self._streams = Streams(kv)
        # Flat byte views of the engine's segments: a block's piece is a slice of one
        # (about 0.1 us), where a numpy row's buffer export costs microseconds per block.
        # A plane's blocks may be strided (vLLM's pages hold a block's K then its V, so
        # each plane's rows are a page apart): one stride for all planes, or staging rows.
        segments = kv.segments
        self._stride = segments[0].stride(0)
        on_cpu = (
            kv.device.type == "cpu"
            and not kv.is_cuda
            and all(seg.stride() == (self._stride, 1) for seg in segments)
        )
        self._flat = [_flat_bytes(seg) for seg in segments] if on_cpu else []
        self._seg_bytes = kv.layout.segment_bytes
        self._rows = on_cpu and len(self._flat) == 1 and self._stride == self._seg_bytes
        # a store that reads and writes a block's segments where they lie (the disk):
        # no staging rows, so no copy through them and no buffer of the largest job
        self._segmented = on_cpu and not self._rows and hasattr(store, "write_segments")
        self._staging: dict[str, _Staging] = {}
        # held while a store uses the "store" staging rows: a worker's store threads
        # (`TransferWorker`'s `store_threads`) share them
        self._staging_lock = threading.Lock()
        # snapshots' rows written out and kept for the next (`snapshot`), oldest first
        self._free_snapshots: list[_Staging] = []
        self._snapshot_lock = threading.Lock()
        # on a GPU: one kernel between the device and the pinned staging rows (a
        # segment's rows are strided there, which a DMA per segment would copy slowly)
        self._kernel = KernelCopier.for_device(kv)

    def ready_event(self) -> Any:
        return self.kv.record_compute()

    @property
    def staging_bytes(self) -> int:
        """Host bytes held for staging (pinned with CUDA): grown to the largest job, kept."""
        return sum(s.buffer.numel() for s in self._staging.values())

    def snapshot(self, device_ids: npt.NDArray[np.int64]) -> _Staging:
        """A copy of these device blocks in host rows of their own, taken now on the
        calling thread. For a store that may wait long for its medium (a slow Redis): set
        as the store spec's `staged`, the store writes from it, so the engine may reuse
        the blocks at once. A CPU device only: there the blocks' last writes are done
        when their store is submitted (a GPU's would need the compute stream's event)."""
        if self.kv.device.type != "cpu":
            raise ValueError(f"snapshot of blocks on {self.kv.device}: a CPU device only")
        staging = self._snapshot_rows(len(device_ids))
        self._to_staging(device_ids, staging)
        return staging

    def _snapshot_rows(self, count: int) -> _Staging:
        """Rows for a snapshot of `count` blocks: a written-out snapshot's of that many
        rows (the newest), or new ones; exactly as many, so a queued snapshot holds the
        bytes its store queue counts and no more. On the engine's own thread, new rows
        cost their pages' first writes: a 32-block snapshot (8 MiB) of the serving model
        took 10-20 ms of every request's prefill there, 9% of the worker's time at
        saturation with a Redis tier (bench_serving's no-reuse workload)."""
        staging = None
        with self._snapshot_lock:
            for i in range(len(self._free_snapshots) - 1, -1, -1):
                if len(self._free_snapshots[i].rows) == count:
                    staging = self._free_snapshots.pop(i)
                    break
        if staging is None:
            staging = _Staging(self.kv.layout, count, pin_memory=False)
            staging.pool = self
        return staging

    def recycle(self, staging: _Staging) -> None:
        """Keep a written-out snapshot's rows for the next (SNAPSHOT_POOL_BYTES and
        SNAPSHOT_POOL_COUNT at most, the oldest dropped first)."""
        block_bytes = self.kv.layout.bytes_per_block
        with self._snapshot_lock:
            free = self._free_snapshots
            free.append(staging)
            while len(free) > SNAPSHOT_POOL_COUNT or (
                sum(len(f.rows) for f in free) * block_bytes > SNAPSHOT_POOL_BYTES
            ):
                free.pop(0)

    def store(self, device_ids: npt.NDArray[np.int64], spec: LoadStoreSpec, ready: Any) -> int:
        moved = len(device_ids) * self.kv.layout.bytes_per_block
        staged: _Staging | SlotPieces | None = getattr(spec, "staged", None)
        if staged is not None:  # copied out of the engine's blocks before (see both)
            try:
                staged.write_to(self.medium, spec)
            finally:
                spec.staged = None  # type: ignore[attr-defined]  # its memory goes now
                if isinstance(staged, _Staging) and staged.pool is self:
                    self.recycle(staged)
            return moved
        if self._rows:
            self.medium.write_blocks(spec, self._row_views(device_ids))
            return moved
        if self._segmented:
            self.medium.write_segments(spec, self._segment_views(device_ids))  # type: ignore[attr-defined]
            return moved
        with self._staging_lock:  # one staging buffer, however many store threads
            staging = self._stage("store", len(device_ids))
            self._streams.run(
                self._streams.store, ready, lambda: self._to_staging(device_ids, staging)
            )
            self.medium.write_blocks(spec, staging.rows[: len(device_ids)])
        return moved

    def load(
        self,
        spec: LoadStoreSpec,
        device_ids: npt.NDArray[np.int64],
        ready: Any = None,
        guard: Guard | None = None,
    ) -> int:
        """`guard` (default `spec.guard`): the load may be given up at its deadline (see
        `kv_store.LoadGuard`); once given up, not one byte may reach the engine's blocks,
        which are being recomputed. So a guarded load never reads straight into them: it
        reads into the staging rows, and the copy into the engine runs under the guard;
        a medium that copies under its spec's guard itself (`copies_under_guard`: the
        Redis tier's, whose bytes arrive off the socket and are copied once anyway) reads
        straight into them, saving a copy of every byte (78 ms of a 4,096-token load of
        the 0.5B-shaped model here)."""
        moved = len(device_ids) * self.kv.layout.bytes_per_block
        on_spec = getattr(spec, "guard", None)
        if guard is None:
            guard = on_spec
        medium_guards = guard is on_spec and getattr(self.medium, "copies_under_guard", False)
        if self._rows and (guard is None or medium_guards):
            self.medium.read_blocks(spec, self._row_views(device_ids))
            return moved
        if self._segmented and guard is None:
            self.medium.read_segments(spec, self._segment_views(device_ids))  # type: ignore[attr-defined]
            return moved
        staging = self._stage("load", len(device_ids))
        self.medium.read_blocks(spec, staging.rows[: len(device_ids)])
        with holding(guard, "the staged load"):
            self._streams.run(
                self._streams.load, ready, lambda: self._from_staging(staging, device_ids)
            )
        return moved

    def _to_staging(self, device_ids: npt.NDArray[np.int64], staging: _Staging) -> int:
        slots = np.arange(len(device_ids), dtype=np.int64)
        if self._kernel is not None:
            return self._kernel.to_host(device_ids, self._rows_side(staging), slots)
        return copy_blocks(self.kv.segments, device_ids, staging.segments, slots)

    def _from_staging(self, staging: _Staging, device_ids: npt.NDArray[np.int64]) -> int:
        slots = np.arange(len(device_ids), dtype=np.int64)
        if self._kernel is not None:
            return self._kernel.from_host(self._rows_side(staging), slots, device_ids)
        return copy_blocks(staging.segments, slots, self.kv.segments, device_ids)

    def _rows_side(self, staging: _Staging) -> HostSide:
        assert self._kernel is not None
        layout = self.kv.layout
        return self._kernel.host_side(staging.buffer, layout.bytes_per_block, layout.segment_bytes)

    def _row_views(self, device_ids: npt.NDArray[np.int64]) -> list[memoryview]:
        rows, size = self._flat[0], self._seg_bytes
        return [rows[i * size : (i + 1) * size] for i in device_ids.tolist()]

    def _segment_views(self, device_ids: npt.NDArray[np.int64]) -> list[list[memoryview]]:
        return block_segments(self._flat, self._seg_bytes, device_ids.tolist(), self._stride)

    def _stage(self, direction: str, num_blocks: int) -> _Staging:
        """This direction's staging rows, grown (never shrunk) to fit the job."""
        staging = self._staging.get(direction)
        if staging is None or len(staging.rows) < num_blocks:
            size = max(num_blocks, 2 * len(staging.rows) if staging else 8)
            staging = _Staging(self.kv.layout, size, pin_memory=self.kv.device.type == "cuda")
            self._staging[direction] = staging
        return staging


def _flat_bytes(segment: torch.Tensor) -> memoryview:
    """A CPU segment `[num_blocks, segment_bytes]` (rows `stride(0)` apart) as one flat
    byte view from its first row's start to its last row's end."""
    num_blocks, size = segment.shape
    extent = (num_blocks - 1) * segment.stride(0) + size
    return segment.as_strided((extent,), (1,)).numpy().data.cast("B")


class SlotPieces:
    """A store's blocks as the CPU tier's slots hold them, for a store that follows the
    CPU tier's copy of the same blocks (a Redis store of blocks the job also puts in the
    CPU tier): written from the slots' segments where they lie, with no copy of its own.
    The slots must not be rewritten until the store ends: the job's slots stay in flight
    (neither read nor evicted) until its every part is done. The medium takes blocks as
    pieces (`write_pieces`). `order`: where the medium's rows are the slots' bytes in
    another order (Redis values by KV head, `slot_order`), each row's runs as (the
    slot's segment, offset, length)."""

    def __init__(
        self,
        memory: MemoryStore,
        slots: npt.NDArray[np.int64],
        order: Sequence[tuple[int, int, int]] | None = None,
    ) -> None:
        self.memory = memory
        self.slots = slots
        self.order = order

    def write_to(self, medium: Any, spec: LoadStoreSpec) -> None:
        parts = self.memory.slot_parts(self.slots)
        if self.order is not None:
            parts = [[p[j][off : off + n] for j, off, n in self.order] for p in parts]
        medium.write_pieces(spec, parts)


def slot_order(whole: DeviceKV, rows: DeviceKV) -> list[tuple[int, int, int]] | None:
    """Where each segment of `rows` (a view of the same engine memory in another order:
    a worker's KV heads one after the other, `PagedDeviceKV(heads=)`) lies in the
    segments of `whole` (the CPU slots' layout): (segment, offset, length) each, so that
    a row is written from a CPU slot's bytes (`SlotPieces`) rather than copied on the
    engine's thread (`StagedHandler.snapshot`); None where some segment of `rows` is
    not inside one of `whole`'s at the same block stride (or either is on a GPU)."""
    if whole.is_cuda or rows.is_cuda:
        return None
    spans = [(seg.data_ptr(), seg.stride(0), int(seg.shape[1])) for seg in whole.segments]
    order = []
    for seg in rows.segments:
        ptr, stride, size = seg.data_ptr(), seg.stride(0), int(seg.shape[1])
        at = next(
            (
                (j, ptr - base)
                for j, (base, step, length) in enumerate(spans)
                if step == stride and 0 <= ptr - base <= length - size
            ),
            None,
        )
        if at is None or seg.stride(1) != 1 or seg.element_size() != 1:
            return None
        order.append((at[0], at[1], size))
    return order


class _Staging:
    """Contiguous host rows (what `BlockStore.write_blocks` takes), cut into segment
    views `[num_rows, seg]` like a device cache for the gather/scatter copies."""

    def __init__(self, layout: KVLayout, num_rows: int, *, pin_memory: bool) -> None:
        size = layout.segment_bytes
        # (in huge pages off CUDA: a job's first use of fresh 4 KiB pages is slow; and
        # zeroed lazily, page by page as written: a snapshot's rows cost no zeroing pass)
        self.buffer = host_buffer((num_rows, layout.bytes_per_block), pin_memory=pin_memory)
        self.segments = [
            self.buffer[:, k * size : (k + 1) * size] for k in range(layout.num_segments)
        ]
        self.rows = [memoryview(row) for row in self.buffer.numpy()]
        self.pool: StagedHandler | None = None  # whose snapshot rows these are

    def write_to(self, medium: BlockStore, spec: LoadStoreSpec) -> None:
        medium.write_blocks(spec, self.rows)
