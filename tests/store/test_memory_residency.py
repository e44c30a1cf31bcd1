"""The CPU tier's host buffer costs resident memory only for the slots written.

Measured with `mincore(2)`, which reports exactly which pages of a mapping are in
memory: no process-wide RSS, so other allocations cannot blur the count.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import pytest

from kvtier.connector.tier_stack import StackConfig, build_tiers
from kvtier.offload import CPUOffloadingManager, OffloadingManager
from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.store.layout import KVLayout
from kvtier.store.memory import MemoryStore
from kvtier.types import BlockHash

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="mincore(2) as Linux has it")

# segments of 64 KiB (page-aligned in every plane), 4 segments a block of 256 KiB
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, block_size=128, dtype="float32")
PLANES = LAYOUT.num_segments


def huge_page_bytes() -> int:
    """The size of a transparent huge page (the buffer asks for them where offered)."""
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return mmap.PAGESIZE


def resident_bytes(store: MemoryStore) -> int:
    """Bytes of the store's buffer in memory, by page (pages never read nor written are
    not; this test never reads a slot it did not write)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = store.buffer.numel()
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(store.buffer.data_ptr()), ctypes.c_size_t(size), vec):
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


def write(store: MemoryStore, slots: list[int]) -> None:
    rows = [memoryview(bytearray([s % 251 + 1]) * LAYOUT.bytes_per_block) for s in slots]
    store.write_blocks(CPULoadStoreSpec(slots), rows)


def test_an_unwritten_buffer_is_not_resident_and_a_write_makes_only_its_pages_so() -> None:
    assert LAYOUT.segment_bytes % mmap.PAGESIZE == 0
    store = MemoryStore(LAYOUT, 1024, pin_memory=False)  # 256 MiB
    assert resident_bytes(store) == 0
    write(store, [5, 1000])
    # each slot's segment in each plane: its own pages, or the huge page holding them
    assert 2 * LAYOUT.bytes_per_block <= resident_bytes(store)
    assert resident_bytes(store) <= 2 * PLANES * max(huge_page_bytes(), LAYOUT.segment_bytes)
    out = bytearray(LAYOUT.bytes_per_block)
    store.read_blocks(CPULoadStoreSpec([1000]), [memoryview(out)])
    assert out == bytearray([1000 % 251 + 1]) * LAYOUT.bytes_per_block
    assert bytes(store.array[6]) == bytes(LAYOUT.bytes_per_block)  # unwritten: zeros


def hashes(n: int, start: int) -> list[BlockHash]:
    return [BlockHash(i.to_bytes(8, "big")) for i in range(start, start + n)]


def fill_and_reset(cpu: OffloadingManager, store: MemoryStore, rounds: int, n: int) -> None:
    """`rounds` times: store `n` new blocks (their bytes written), then reset the tier,
    as a benchmark does between runs (`POST /reset_prefix_cache`)."""
    for r in range(rounds):
        keys = hashes(n, r * n)
        out = cpu.prepare_store(keys)
        assert out is not None
        write(store, out.store_spec.block_ids.tolist())  # type: ignore[attr-defined]
        cpu.complete_store(keys)
        cpu.reset_cache()


def test_the_tier_stacks_cpu_tier_writes_no_more_slots_than_it_ever_held_at_once() -> None:
    tiers = build_tiers(StackConfig(block_size=16, cpu_blocks=256))
    store = MemoryStore(LAYOUT, 256, pin_memory=False)
    fill_and_reset(tiers.local, store, rounds=5, n=40)
    # slots 0..39, and at most one part-filled huge page a plane
    assert 40 * LAYOUT.bytes_per_block <= resident_bytes(store)
    assert resident_bytes(store) <= 40 * LAYOUT.bytes_per_block + PLANES * huge_page_bytes()


def test_vllms_slot_order_walks_into_fresh_slots_after_each_reset() -> None:
    """The reason for the stack's order: vLLM's, kept by `CPUOffloadingManager`'s
    default, writes a new 40 slots each round until the buffer is all resident."""
    cpu = CPUOffloadingManager(16, 256)
    store = MemoryStore(LAYOUT, 256, pin_memory=False)
    fill_and_reset(cpu, store, rounds=5, n=40)
    assert resident_bytes(store) >= 200 * LAYOUT.bytes_per_block
