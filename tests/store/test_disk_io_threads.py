"""Disk jobs of many blocks, spread over I/O threads: the same bytes, the same
failure accounting, and no read at all when a block of the job is missing."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from kvtier.store import disk_store as disk_module
from kvtier.store.disk_store import DiskStore
from kvtier.store.diskformat import file_name
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError
from kvtier.types import int_block_hash

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=16, block_size=4)  # 4 segments
SEG = LAYOUT.segment_bytes
HASHES = [int_block_hash(i) for i in range(9)]


def payload(i: int) -> bytes:
    return random.Random(i).randbytes(LAYOUT.bytes_per_block)


def segments(data: bytearray) -> list[memoryview]:
    view = memoryview(data)
    return [view[k : k + SEG] for k in range(0, len(data), SEG)]


def open_store(root: Path, io_threads: int, parallel_min_bytes: int = 0) -> DiskStore:
    """Tiny blocks, so every job of two or more goes parallel unless told otherwise."""
    capacity = DiskStore.capacity_for(LAYOUT, 16)
    return DiskStore(
        root, LAYOUT, capacity, io_threads=io_threads, parallel_min_bytes=parallel_min_bytes
    )


@pytest.mark.parametrize("io_threads", [1, 2, 3, 16])
def test_a_job_round_trips_through_its_segments(tmp_path: Path, io_threads: int) -> None:
    store = open_store(tmp_path, io_threads)
    sources = [bytearray(payload(i)) for i in range(len(HASHES))]
    store.write_parts(HASHES, [segments(s) for s in sources])
    targets = [bytearray(LAYOUT.bytes_per_block) for _ in HASHES]
    store.read_parts(HASHES, [segments(t) for t in targets])
    store.close()
    assert targets == sources
    stats = store.stats()
    assert stats.num_blocks == len(HASHES)
    assert stats.used_bytes == len(HASHES) * store.file_bytes(HASHES[0])
    assert sorted(p.name for p in store.directory.iterdir()) == sorted(
        ["layout.json", "lock", *(file_name(h) for h in HASHES)]
    )


def test_a_corrupt_block_fails_the_job_and_only_damaged_ones_are_dropped(tmp_path: Path) -> None:
    store = open_store(tmp_path, io_threads=2)
    store.write(HASHES, [payload(i) for i in range(len(HASHES))])
    for i in (1, 7):
        path = store.directory / file_name(HASHES[i])
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    targets = [memoryview(bytearray(LAYOUT.bytes_per_block)) for _ in HASHES]
    with pytest.raises(BlockLoadError, match="checksum mismatch"):
        store.read(HASHES, targets)
    # Block 1 is always reached (one thread takes it at once); block 7 may be skipped
    # once the job has failed, and is then found at its next load.
    first = store.take_dropped()
    assert HASHES[1] in first and set(first) <= {HASHES[1], HASHES[7]}
    assert store.stats().checksum_failures == len(first)
    if HASHES[7] not in first:
        with pytest.raises(BlockLoadError, match="checksum mismatch"):
            store.read([HASHES[7]], targets[:1])
    assert store.stats().checksum_failures == 2
    assert HASHES[1] not in store and HASHES[7] not in store
    intact = [h for i, h in enumerate(HASHES) if i not in (1, 7)]
    buffers = [memoryview(bytearray(LAYOUT.bytes_per_block)) for _ in intact]
    store.read(intact, buffers)
    assert [bytes(b) for b in buffers] == [payload(i) for i in range(9) if i not in (1, 7)]


def test_a_missing_block_fails_the_job_before_anything_is_read(tmp_path: Path) -> None:
    store = open_store(tmp_path, io_threads=2)
    store.write(HASHES[:4], [payload(i) for i in range(4)])
    job = [HASHES[0], HASHES[1], HASHES[8], HASHES[2]]
    targets = [bytearray(LAYOUT.bytes_per_block) for _ in job]
    with pytest.raises(BlockLoadError, match=f"{HASHES[8].hex()} is not stored"):
        store.read(job, [memoryview(t) for t in targets])
    assert all(t == bytearray(LAYOUT.bytes_per_block) for t in targets)
    assert store.stats().missing == 1 and store.take_dropped() == [HASHES[8]]


def test_a_failed_block_write_keeps_the_completed_ones_and_releases_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path, io_threads=2)
    real = disk_module.durable_write
    broken = store._path(HASHES[6])

    def durable_write(final: str, tmp: str, parts: list[bytes], fsync: bool) -> None:
        if final == broken:
            raise OSError("no space left on device")
        real(final, tmp, parts, fsync)

    monkeypatch.setattr(disk_module, "durable_write", durable_write)
    with pytest.raises(OSError, match="no space left"):
        store.write(HASHES, [payload(i) for i in range(len(HASHES))])
    monkeypatch.undo()
    kept = [h for h in HASHES if h in store]
    assert HASHES[6] not in kept and len(kept) >= 5  # the blocks before it completed
    assert store.stats().used_bytes == len(kept) * store.file_bytes(HASHES[0])
    names = {p.name for p in store.directory.iterdir()}
    assert names == {"layout.json", "lock", *(file_name(h) for h in kept)}  # no temp file left
    buffers = [memoryview(bytearray(LAYOUT.bytes_per_block)) for _ in kept]
    store.read(kept, buffers)
    assert [bytes(b) for b in buffers] == [payload(HASHES.index(h)) for h in kept]


@pytest.mark.parametrize(
    ("min_bytes", "parallel"),
    [(0, True), (9 * LAYOUT.bytes_per_block, True), (9 * LAYOUT.bytes_per_block + 1, False)],
)
def test_only_jobs_of_parallel_min_bytes_use_a_second_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, min_bytes: int, parallel: bool
) -> None:
    store = open_store(tmp_path, io_threads=2, parallel_min_bytes=min_bytes)
    store.write(HASHES, [payload(i) for i in range(len(HASHES))])
    release = threading.Event()
    threads: set[int] = set()
    real = DiskStore._read_one

    def read_one(self: DiskStore, *args: object) -> None:
        threads.add(threading.get_ident())
        if len(threads) == 2:
            release.set()
        elif parallel:  # hold the first thread until a second one has taken a block
            release.wait(timeout=30)
        real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskStore, "_read_one", read_one)
    targets = [memoryview(bytearray(LAYOUT.bytes_per_block)) for _ in HASHES]
    store.read(HASHES, targets)
    store.close()
    assert len(threads) == (2 if parallel else 1)
    assert [bytes(t) for t in targets] == [payload(i) for i in range(len(HASHES))]


def test_io_threads_below_one_and_negative_min_bytes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="io_threads must be >= 1, got 0"):
        open_store(tmp_path, io_threads=0)
    with pytest.raises(ValueError, match="parallel_min_bytes must be >= 0, got -1"):
        open_store(tmp_path, io_threads=2, parallel_min_bytes=-1)
