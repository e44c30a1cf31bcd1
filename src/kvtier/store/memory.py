"""The memory tier: one host buffer of fixed-size slots, addressed by slot id.

The CPU offloading manager hands out slot ids (`CPULoadStoreSpec.block_ids`); slot
`i` is row `i` of one `[num_slots, bytes_per_block]` uint8 tensor. One allocation up
front means no per-block allocation on the hot path, and with CUDA the buffer is
pinned so device copies run asynchronously on a copy stream.

Checksums are optional here (`checksums=True`): host RAM does not tear or rot like a
disk, and hashing every block costs about as much as copying it, which would halve
the tier's bandwidth. When enabled, a checksum is recorded when a slot is written and
verified before it is read; a mismatch fails the load and is counted.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.offload.mediums import BlockIDsLoadStoreSpec
from kvtier.store.checksum import block_checksum
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
        self.buffer: torch.Tensor = torch.zeros(
            (num_slots, layout.bytes_per_block), dtype=torch.uint8, pin_memory=pin_memory
        )
        self.array: npt.NDArray[np.uint8] = self.buffer.numpy()
        self._sums = np.zeros(num_slots, dtype=np.uint64)
        self._lock = threading.Lock()
        self.num_checksum_failures = 0

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def segments(self) -> list[torch.Tensor]:
        """The buffer cut like a device cache: `num_segments` views `[num_slots, seg]`."""
        if not self._layout.per_layer:
            return [self.buffer]
        size = self._layout.segment_bytes
        return [self.buffer[:, i * size : (i + 1) * size] for i in range(self._layout.num_segments)]

    def segment_arrays(self) -> list[npt.NDArray[np.uint8]]:
        """`segments()` as numpy views (what CPU copies use; cheaper to keep than remake)."""
        return [segment.numpy() for segment in self.segments()]

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
            for slot in slot_ids.tolist():
                self._sums[slot] = block_checksum(self.array[slot])

    def verify(self, slot_ids: npt.NDArray[np.int64]) -> None:
        """Raise `BlockLoadError` (and count) if a slot no longer matches its checksum."""
        if not self.checksums:
            return
        bad = [s for s in slot_ids.tolist() if block_checksum(self.array[s]) != self._sums[s]]
        if bad:
            with self._lock:
                self.num_checksum_failures += len(bad)
            raise BlockLoadError(f"checksum mismatch in memory slots {bad}")

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        slots = self._checked(spec, blocks)
        for slot, block in zip(slots.tolist(), blocks, strict=True):
            self.array[slot] = np.frombuffer(block, dtype=np.uint8)
        self.seal(slots)

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        slots = self._checked(spec, blocks)
        self.verify(slots)
        for slot, block in zip(slots.tolist(), blocks, strict=True):
            np.frombuffer(block, dtype=np.uint8)[:] = self.array[slot]

    def _checked(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> npt.NDArray[np.int64]:
        slots = self.slot_ids(spec)
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} buffers for {len(slots)} slots")
        return slots
