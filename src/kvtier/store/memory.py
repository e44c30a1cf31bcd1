"""The memory tier: one host buffer of fixed-size slots, addressed by slot id.

The CPU offloading manager hands out slot ids (`CPULoadStoreSpec.block_ids`). The
buffer is one `[num_segments, num_slots, segment_bytes]` uint8 tensor, segment-major:
segment `k` of every slot lies in one contiguous `[num_slots, segment_bytes]` plane,
shaped like the engine's own per-layer planes. So a job of consecutive slots is one
contiguous copy per segment (1 MiB for 64 blocks of 256 KiB), where slot-major rows
would cut it into one 16-32 KiB piece per block and segment; and a gather of shuffled
device blocks lands in one contiguous run. A block's bytes as a whole (what the disk
format and checksums see) are its segments concatenated in layout order: `slot_parts`.
For the cross-layer layout there is one segment, so the buffer is plain slot rows.

One allocation up front means no per-block allocation on the hot path. Without CUDA
the buffer is a private anonymous mapping: the kernel gives it a zeroed page on the
page's first write, so the tier costs resident memory only for the slots written so
far (a 1 GiB tier is not 1 GiB of RSS at start; `CPUBackend(reuse_freed_first=True)`
keeps the slots written few). With CUDA the buffer is pinned so device copies run
asynchronously on a copy stream; page-locked memory is resident by definition
(`cudaHostAlloc` maps and locks every page), so it is allocated whole as before.

Checksums are optional here (`checksums=True`): host RAM does not tear or rot like a
disk, and hashing every block costs about as much as copying it, which would halve
the tier's bandwidth. When enabled, a checksum is recorded when a slot is written and
verified before it is read; a mismatch fails the load and is counted.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, overload

import numpy as np
import numpy.typing as npt

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.offload.mediums import BlockIDsLoadStoreSpec
from kvtier.store.checksum import segments_checksum
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError

if TYPE_CHECKING:
    import torch


class MemoryStore:
    """Host slots for the CPU tier; also a `BlockStore` over slot-id specs."""

    def __init__(
        self,
        layout: KVLayout,
        num_slots: int,
        *,
        pin_memory: bool | None = None,
        checksums: bool = False,
    ) -> None:
        import torch

        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self._layout = layout
        self.num_slots = num_slots
        self.checksums = checksums
        shape = (layout.num_segments, num_slots, layout.segment_bytes)
        self.buffer: torch.Tensor = host_buffer(shape, pin_memory=pin_memory)
        self._arrays: list[npt.NDArray[np.uint8]] = list(self.buffer.numpy())
        # Flat byte views of the planes: a slot's segment is a slice (about 0.1 us), where
        # a numpy row's buffer export costs microseconds, paid per block and segment.
        self._flat = [plane.data.cast("B") for plane in self._arrays]
        self.array = SlotRows(self._flat, layout.segment_bytes)
        self._sums = np.zeros(num_slots, dtype=np.uint64)
        self._lock = threading.Lock()
        self.num_checksum_failures = 0

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def segments(self) -> list[torch.Tensor]:
        """The buffer cut like a device cache: `num_segments` contiguous `[num_slots, seg]`."""
        return list(self.buffer)

    def segment_arrays(self) -> list[npt.NDArray[np.uint8]]:
        """`segments()` as numpy views (what CPU copies use; cheaper to keep than remake)."""
        return list(self._arrays)

    def slot_parts(self, slots: Sequence[int] | npt.NDArray[np.int64]) -> list[list[memoryview]]:
        """Each slot's bytes as its segments in layout order (writable views, no copy)."""
        ids = np.asarray(slots, dtype=np.int64).tolist()
        return block_segments(self._flat, self._layout.segment_bytes, ids)

    def slot_ids(self, spec: LoadStoreSpec) -> npt.NDArray[np.int64]:
        """The spec's slot ids, validated against the buffer."""
        if not isinstance(spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"MemoryStore needs a slot-id spec, got {type(spec).__name__}")
        ids = spec.block_ids
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_slots):
            raise ValueError(f"slot ids {ids.tolist()} outside [0, {self.num_slots})")
        return ids

    def seal(self, slot_ids: npt.NDArray[np.int64]) -> None:
        """Record checksums of freshly written slots (no-op unless `checksums`)."""
        if self.checksums:
            for slot, parts in zip(slot_ids.tolist(), self.slot_parts(slot_ids), strict=True):
                self._sums[slot] = segments_checksum(parts)

    def verify(self, slot_ids: npt.NDArray[np.int64]) -> None:
        """Raise `BlockLoadError` (and count) if a slot no longer matches its checksum."""
        if not self.checksums:
            return
        slots = slot_ids.tolist()
        bad = [
            slot
            for slot, parts in zip(slots, self.slot_parts(slot_ids), strict=True)
            if segments_checksum(parts) != self._sums[slot]
        ]
        if bad:
            with self._lock:
                self.num_checksum_failures += len(bad)
            raise BlockLoadError(f"checksum mismatch in memory slots {bad}")

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        slots = self._checked(spec, blocks)
        for parts, block in zip(self.slot_parts(slots), blocks, strict=True):
            self._split(block, parts, into_slot=True)
        self.seal(slots)

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        slots = self._checked(spec, blocks)
        self.verify(slots)
        for parts, block in zip(self.slot_parts(slots), blocks, strict=True):
            self._split(block, parts, into_slot=False)

    def _split(self, block: memoryview, parts: list[memoryview], *, into_slot: bool) -> None:
        """Copy a whole row to (or from) a slot's segments."""
        row = memoryview(block).cast("B")
        size = self._layout.segment_bytes
        for k, part in enumerate(parts):
            if into_slot:
                part[:] = row[k * size : (k + 1) * size]
            else:
                row[k * size : (k + 1) * size] = part

    def _checked(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> npt.NDArray[np.int64]:
        slots = self.slot_ids(spec)
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} buffers for {len(slots)} slots")
        size = self._layout.bytes_per_block
        for block in blocks:
            if memoryview(block).nbytes != size:
                raise ValueError(f"block of {memoryview(block).nbytes} bytes, layout needs {size}")
        return slots


def host_buffer(shape: tuple[int, ...], *, pin_memory: bool) -> torch.Tensor:
    """A zeroed uint8 tensor of `shape` in host memory: pinned (resident, allocated by
    CUDA) or a private anonymous mapping whose pages become resident when first written,
    in transparent huge pages (2 MiB) where the kernel offers them. With slots used from
    0 up (`CPUBackend`), what is resident is then the used slots' bytes plus at most one
    part-filled huge page per segment plane. The tensor holds the mapping; it is unmapped
    when the last view of it goes."""
    import torch

    if pin_memory:
        return torch.zeros(shape, dtype=torch.uint8, pin_memory=True)
    size = math.prod(shape)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no transparent huge pages here
        # a first write of a 4 KiB page costs a fault and its zeroing: four times a copy
        # into a written one (96 MiB: 105 ms against 24 ms); huge pages take 16-32 ms
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(shape)


def block_segments(
    planes: Sequence[memoryview], segment_bytes: int, ids: Iterable[int], stride: int = 0
) -> list[list[memoryview]]:
    """Block `i`'s segments, for each `i` in `ids`: row `i` of every flat byte plane, in
    layout order (views, no copy). `stride`: the bytes from one block's row to the next
    in every plane (default `segment_bytes`: rows back to back; vLLM's pages put a
    block's K and V rows side by side, a page apart). Slicing a flat `memoryview` costs
    about 0.1 us, where a numpy row's buffer export costs microseconds, paid per block
    and segment."""
    step = stride or segment_bytes
    views = []
    for i in ids:
        piece = slice(i * step, i * step + segment_bytes)  # one slice object for all
        views.append([plane[piece] for plane in planes])  # segments: a third cheaper
    return views


class SlotRows:
    """The slots as rows of `bytes_per_block` bytes in layout order, over the segment-major
    buffer: `rows[slot][i]` and `rows[slot, i]` read or write byte `i` of a slot, and
    `bytes(rows[slot])` copies a slot out. For inspection and tests; copies of blocks go
    through `MemoryStore.segments()` and `slot_parts()`."""

    def __init__(self, planes: list[memoryview], segment_bytes: int) -> None:
        self.planes = planes
        self.segment_bytes = segment_bytes
        self.row_bytes = segment_bytes * len(planes)

    def __len__(self) -> int:
        return len(self.planes[0]) // self.segment_bytes

    @overload
    def __getitem__(self, key: int) -> SlotRow: ...

    @overload
    def __getitem__(self, key: tuple[int, int]) -> int: ...

    def __getitem__(self, key: int | tuple[int, int]) -> SlotRow | int:
        if isinstance(key, tuple):
            slot, index = key
            return self.row(slot)[index]
        return self.row(key)

    def __setitem__(self, key: tuple[int, int], value: int) -> None:
        slot, index = key
        self.row(slot)[index] = value

    def row(self, slot: int) -> SlotRow:
        if not -len(self) <= slot < len(self):
            raise IndexError(f"slot {slot} outside [0, {len(self)})")
        return SlotRow(self, int(slot) % len(self))


class SlotRow:
    """One slot of `SlotRows`, indexed by byte."""

    def __init__(self, rows: SlotRows, slot: int) -> None:
        self._rows = rows
        self.slot = slot

    def __len__(self) -> int:
        return self._rows.row_bytes

    def __getitem__(self, index: int) -> int:
        plane, offset = self._locate(index)
        return int(plane[offset])

    def __setitem__(self, index: int, value: int) -> None:
        plane, offset = self._locate(index)
        plane[offset] = value

    def __bytes__(self) -> bytes:
        size = self._rows.segment_bytes
        piece = slice(self.slot * size, (self.slot + 1) * size)
        return b"".join(plane[piece] for plane in self._rows.planes)

    def _locate(self, index: int) -> tuple[memoryview, int]:
        """The plane holding this slot's byte `index`, and the byte's offset there."""
        rows = self._rows
        if not -rows.row_bytes <= index < rows.row_bytes:
            raise IndexError(f"byte {index} outside a slot of {rows.row_bytes} bytes")
        segment, offset = divmod(int(index) % rows.row_bytes, rows.segment_bytes)
        return rows.planes[segment], self.slot * rows.segment_bytes + offset
