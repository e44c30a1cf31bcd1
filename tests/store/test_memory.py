"""Memory tier: the segment-major host buffer, slot rows as the disk format sees them, checksums."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.store.layout import KVLayout
from kvtier.store.memory import MemoryStore
from kvtier.store.protocol import BlockLoadError

PER_LAYER = KVLayout(num_layers=3, num_kv_heads=2, head_size=4, block_size=4, dtype="uint8")
CROSS_LAYER = KVLayout(
    num_layers=3, num_kv_heads=2, head_size=4, block_size=4, dtype="uint8", per_layer=False
)
SIZE = PER_LAYER.bytes_per_block  # 96 bytes: 6 segments of 16


def row(seed: int, layout: KVLayout = PER_LAYER) -> bytearray:
    return bytearray(random.Random(seed).randbytes(layout.bytes_per_block))


@pytest.mark.parametrize("layout", [PER_LAYER, CROSS_LAYER], ids=["per_layer", "cross_layer"])
def test_a_slot_is_its_segments_in_layout_order(layout: KVLayout) -> None:
    store = MemoryStore(layout, 5)
    rows = [row(i, layout) for i in range(5)]
    store.write_blocks(CPULoadStoreSpec([4, 0, 2, 1, 3]), [memoryview(r) for r in rows])
    seg = layout.segment_bytes
    for slot, data in zip([4, 0, 2, 1, 3], rows, strict=True):
        parts = store.slot_parts([slot])[0]
        assert b"".join(parts) == bytes(data) == bytes(store.array[slot])
        for k, plane in enumerate(store.segment_arrays()):  # segment k of slot: plane k, row slot
            assert plane[slot].tobytes() == bytes(data[k * seg : (k + 1) * seg])
    # Consecutive slots' pieces of one segment are contiguous: one copy per job and segment.
    assert all(s.is_contiguous() and s.shape == (5, seg) for s in store.segments())
    assert len(store.segments()) == layout.num_segments
    out = [bytearray(layout.bytes_per_block) for _ in range(2)]
    store.read_blocks(CPULoadStoreSpec([2, 4]), [memoryview(o) for o in out])
    assert out == [rows[2], rows[0]]


def test_slot_rows_index_bytes_across_segments() -> None:
    store = MemoryStore(PER_LAYER, 3)
    data = row(7)
    store.write_blocks(CPULoadStoreSpec([1]), [memoryview(data)])
    rows = store.array
    assert len(rows) == 3 and len(rows[1]) == SIZE
    for i in (0, 15, 16, 17, 40, SIZE - 1, -1, -SIZE):
        assert rows[1][i] == data[i] == rows[1, i]
    rows[1][17] ^= 0xFF
    rows[1, -1] = 7
    data[17] ^= 0xFF
    data[-1] = 7
    assert bytes(rows[1]) == bytes(data)
    assert bytes(rows[0]) == bytes(SIZE) == bytes(rows[2])
    with pytest.raises(IndexError):
        rows[3]
    with pytest.raises(IndexError):
        rows[1, SIZE]


def test_write_blocks_refuses_wrong_sizes_and_changes_nothing() -> None:
    store = MemoryStore(PER_LAYER, 2)
    good, short = row(1), bytearray(SIZE - 1)
    with pytest.raises(ValueError, match="layout needs"):
        store.write_blocks(CPULoadStoreSpec([0, 1]), [memoryview(good), memoryview(short)])
    with pytest.raises(ValueError, match="2 slots"):
        store.write_blocks(CPULoadStoreSpec([0, 1]), [memoryview(good)])
    with pytest.raises(ValueError, match="outside"):
        store.write_blocks(CPULoadStoreSpec([2]), [memoryview(good)])
    assert not np.any(store.buffer.numpy())


class MemoryStoreMachine(RuleBasedStateMachine):
    """Whatever the writes, reads and bit flips: a read returns the last bytes written to
    each slot, and with checksums a flipped byte fails the read and is counted."""

    @initialize(per_layer=st.booleans())
    def start(self, per_layer: bool) -> None:
        self.layout = PER_LAYER if per_layer else CROSS_LAYER
        self.store = MemoryStore(self.layout, 6, checksums=True)
        self.store.seal(np.arange(6, dtype=np.int64))
        self.model: dict[int, bytes] = {s: bytes(SIZE) for s in range(6)}
        self.sealed = dict(self.model)  # what each slot held when last written
        self.failures = 0

    def corrupt(self, slot: int) -> bool:
        return self.model[slot] != self.sealed[slot]

    @rule(
        slots=st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True), seed=st.integers()
    )
    def write(self, slots: list[int], seed: int) -> None:
        rows = [row(seed + i, self.layout) for i in range(len(slots))]
        self.store.write_blocks(CPULoadStoreSpec(slots), [memoryview(r) for r in rows])
        for slot, data in zip(slots, rows, strict=True):
            self.model[slot] = self.sealed[slot] = bytes(data)

    @rule(slot=st.integers(0, 5), index=st.integers(0, SIZE - 1))
    def flip(self, slot: int, index: int) -> None:
        self.store.array[slot, index] ^= 0x01
        model = bytearray(self.model[slot])
        model[index] ^= 0x01
        self.model[slot] = bytes(model)

    @rule(slots=st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True))
    def read(self, slots: list[int]) -> None:
        out = [bytearray(SIZE) for _ in slots]
        bad = [s for s in slots if self.corrupt(s)]
        if bad:
            with pytest.raises(BlockLoadError, match="memory slots"):
                self.store.read_blocks(CPULoadStoreSpec(slots), [memoryview(o) for o in out])
            self.failures += len(bad)
            return
        self.store.read_blocks(CPULoadStoreSpec(slots), [memoryview(o) for o in out])
        assert [bytes(o) for o in out] == [self.model[s] for s in slots]

    @invariant()
    def counted(self) -> None:
        if hasattr(self, "store"):
            assert self.store.num_checksum_failures == self.failures
            assert all(bytes(self.store.array[s]) == self.model[s] for s in range(6))


MemoryStoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=20)
test_memory_store_model = MemoryStoreMachine.TestCase
