"""Disk tier: durable round trips, recovery, corruption, foreign layouts, byte capacity."""

from __future__ import annotations

import dataclasses
import os
import random
import threading
from pathlib import Path

import pytest

from kvtier.store.disk_store import DiskStore
from kvtier.store.diskformat import file_name
from kvtier.store.layout import KVLayout, LayoutMismatchError
from kvtier.store.protocol import BlockLoadError
from kvtier.types import int_block_hash

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_size=8, block_size=4, dtype="float16")
SIZE = LAYOUT.bytes_per_block  # 256 bytes


def payload(i: int) -> bytes:
    return random.Random(i).randbytes(SIZE)


def open_store(root: Path, blocks: int = 16, **kwargs: object) -> DiskStore:
    capacity = DiskStore.capacity_for(LAYOUT, blocks)
    return DiskStore(root, LAYOUT, capacity, **kwargs)  # type: ignore[arg-type]


def read(store: DiskStore, i: int) -> bytes:
    buffer = bytearray(SIZE)
    store.read([int_block_hash(i)], [memoryview(buffer)])
    return bytes(buffer)


def test_round_trip_and_recovery_after_reopen(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.write([int_block_hash(i) for i in range(5)], [payload(i) for i in range(5)])
    assert [read(store, i) for i in range(5)] == [payload(i) for i in range(5)]
    store.close()  # a directory has one owner at a time
    reopened = open_store(tmp_path)
    assert sorted(reopened.recovered) == [int_block_hash(i) for i in range(5)]
    assert [read(reopened, i) for i in range(5)] == [payload(i) for i in range(5)]
    stats = reopened.stats()
    assert (stats.num_blocks, stats.recovered, stats.dropped_at_recovery) == (5, 5, 0)
    assert stats.used_bytes == 5 * reopened.file_bytes(int_block_hash(0))


def test_recovery_deletes_temp_torn_and_foreign_files(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.write([int_block_hash(i) for i in range(4)], [payload(i) for i in range(4)])
    directory = store.directory
    (directory / (file_name(int_block_hash(9)) + ".123-0.tmp")).write_bytes(b"half a blo")
    blk1 = directory / file_name(int_block_hash(1))
    blk1.write_bytes(blk1.read_bytes()[:-7])  # truncated payload
    blk2 = directory / file_name(int_block_hash(2))
    data = bytearray(blk2.read_bytes())
    data[10] ^= 1  # header bit flip
    blk2.write_bytes(bytes(data))
    os.replace(directory / file_name(int_block_hash(3)), directory / file_name(int_block_hash(7)))
    store.close()  # a directory has one owner at a time
    reopened = open_store(tmp_path)
    assert reopened.recovered == [int_block_hash(0)]
    assert reopened.stats().dropped_at_recovery == 4
    assert {p.name for p in directory.iterdir()} == {
        "layout.json",
        "lock",
        file_name(int_block_hash(0)),
    }


def test_flipped_payload_byte_fails_the_load_drops_and_counts(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.write([int_block_hash(1), int_block_hash(2)], [payload(1), payload(2)])
    path = store.directory / file_name(int_block_hash(1))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(BlockLoadError, match="checksum mismatch"):
        read(store, 1)
    assert store.stats().checksum_failures == 1
    assert store.take_dropped() == [int_block_hash(1)] and store.take_dropped() == []
    assert int_block_hash(1) not in store and not path.exists()
    with pytest.raises(BlockLoadError, match="not stored"):
        read(store, 1)
    assert store.stats().missing == 1
    assert store.take_dropped() == [int_block_hash(1)]
    assert read(store, 2) == payload(2)


def test_another_layout_is_refused_or_ignored(tmp_path: Path) -> None:
    open_store(tmp_path).write([int_block_hash(1)], [payload(1)])
    other = dataclasses.replace(LAYOUT, model_id="another-model")
    with pytest.raises(LayoutMismatchError, match="another layout"):
        DiskStore(tmp_path, other, 1 << 20)
    ignoring = DiskStore(tmp_path, other, 1 << 20, on_mismatch="ignore")
    assert ignoring.recovered == [] and int_block_hash(1) not in ignoring
    assert read(open_store(tmp_path, on_mismatch="ignore"), 1) == payload(1)
    with pytest.raises(ValueError, match="on_mismatch"):
        DiskStore(tmp_path, LAYOUT, 1 << 20, on_mismatch="overwrite")  # type: ignore[arg-type]


def test_capacity_is_bounded_in_bytes(tmp_path: Path) -> None:
    store = open_store(tmp_path, blocks=3)
    assert store.capacity_blocks == 3
    store.write([int_block_hash(i) for i in range(3)], [payload(i) for i in range(3)])
    with pytest.raises(OSError, match="disk tier full"):
        store.write([int_block_hash(3)], [payload(3)])
    assert int_block_hash(3) not in store and store.stats().num_blocks == 3
    store.write([int_block_hash(0)], [payload(7)])  # replacing an existing block needs no room
    assert read(store, 0) == payload(7)
    store.discard([int_block_hash(1), int_block_hash(99)])
    store.write([int_block_hash(3)], [payload(3)])
    assert store.stats().used_bytes <= store.capacity_bytes
    # A smaller capacity at reopen keeps the newest blocks that fit (file times set
    # apart explicitly: writes this close together can share a timestamp).
    for age, i in enumerate((3, 0, 2)):  # block 2 newest, then 0; block 3 oldest
        os.utime(store.directory / file_name(int_block_hash(i)), ns=(age, 10**9 * (age + 1)))
    store.close()
    smaller = open_store(tmp_path, blocks=2)
    assert smaller.recovered == [int_block_hash(0), int_block_hash(2)]  # oldest first
    assert smaller.stats().dropped_at_recovery == 1 and int_block_hash(3) not in smaller
    with pytest.raises(ValueError, match="below one block"):
        DiskStore(tmp_path, LAYOUT, 100)


def test_a_failed_write_leaves_nothing_readable(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    with pytest.raises(ValueError, match="layout needs"):
        store.write([int_block_hash(1)], [b"short"])
    assert store.stats().num_blocks == 0 and store.stats().used_bytes == 0
    assert sorted(p.name for p in store.directory.iterdir()) == ["layout.json", "lock"]


def test_concurrent_writer_reader_and_discards(tmp_path: Path) -> None:
    store = open_store(tmp_path, blocks=64)
    store.write([int_block_hash(i) for i in range(32)], [payload(i) for i in range(32)])
    errors: list[BaseException] = []

    def writer() -> None:
        for i in range(32, 64):
            store.write([int_block_hash(i)], [payload(i)])

    def reader() -> None:
        try:
            for i in range(16, 32):
                assert read(store, i) == payload(i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    store.discard([int_block_hash(i) for i in range(16)])
    for thread in threads:
        thread.join()
    assert errors == []
    assert store.stats().num_blocks == 48
    assert all(read(store, i) == payload(i) for i in range(16, 64))


def test_discard_never_raises_when_the_file_cannot_be_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # discard runs inside the scheduler's prepare_store (via the backend's on_free hook).
    store = open_store(tmp_path)
    store.write([int_block_hash(1), int_block_hash(2)], [payload(1), payload(2)])

    def refuse(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "unlink", refuse)
    store.discard([int_block_hash(1)])
    monkeypatch.undo()
    assert "could not delete" in caplog.text
    assert store.stats().num_blocks == 1  # its bytes no longer count against capacity
    assert read(store, 2) == payload(2)


def test_block_files_deleted_from_outside_the_store_stay_gone_after_reopen(
    tmp_path: Path,
) -> None:
    """A scheduler fencing blocks off (a reset, a shutdown) deletes files itself."""
    from kvtier.store.diskformat import delete_block_files, delete_block_files_except

    store = open_store(tmp_path)
    hashes = [int_block_hash(i) for i in range(5)]
    store.write(hashes, [payload(i) for i in range(5)])
    directory = store.directory
    store.close()
    assert delete_block_files(directory, [*hashes[:2], int_block_hash(99)]) == 2
    assert delete_block_files_except(directory, {hashes[4]}) == 2
    assert delete_block_files_except(tmp_path / "absent", set()) == 0
    reopened = open_store(tmp_path)
    try:
        assert reopened.recovered == [hashes[4]]
        assert (directory / "layout.json").exists()  # only block files are touched
    finally:
        reopened.close()
