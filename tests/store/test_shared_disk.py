"""The shared disk tier: engines of different tensor-parallel sizes on one directory."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvtier.remote.head_codec import HeadGroup, header_size
from kvtier.store.disk_store import DiskStore
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError
from kvtier.store.shared_dir import file_name, list_whole, probe, shared_directory
from kvtier.store.shared_disk import SharedDiskStore
from kvtier.types import int_block_hash
from tests.store.shared_engines import (
    PAGES,
    PIECE,
    SHARED,
    TOTAL,
    engine,
    head_page,
    read,
    row,
    row_layout,
    write,
)


def path_of(root: Path, block: int, group: HeadGroup) -> Path:
    return shared_directory(root, SHARED) / file_name(int_block_hash(block), group)


@pytest.mark.parametrize(("writer", "reader"), [(4, 4), (2, 2), (2, 4), (4, 2), (1, 2), (2, 1)])
def test_an_engine_of_any_size_reads_every_others_blocks(
    tmp_path: Path, writer: int, reader: int
) -> None:
    write(engine(tmp_path, writer), 7)
    for store in engine(tmp_path, reader):
        assert read(store, 7) == row(7, store.group)


def test_a_file_is_the_header_with_each_heads_checksum_then_the_heads_one_by_one(
    tmp_path: Path,
) -> None:
    (store,) = engine(tmp_path, 4)
    write([store], 3)
    data = path_of(tmp_path, 3, HeadGroup(0, 4)).read_bytes()
    body = b"".join(head_page(3, h, p) for h in range(TOTAL) for p in range(PAGES))
    assert data[header_size(4) :] == body  # head-major: any run of heads is one range
    assert len(data) == 40 + 8 * TOTAL + TOTAL * PAGES * PIECE == store.file_bytes


def test_a_lookup_sees_a_block_only_when_every_head_is_there(tmp_path: Path) -> None:
    directory = shared_directory(tmp_path, SHARED)
    workers = engine(tmp_path, 2)
    write(workers[:1], 1)  # heads 0-1 only
    write(workers, 2)
    assert not probe(directory, int_block_hash(1), TOTAL, 4)
    assert probe(directory, int_block_hash(2), TOTAL, 4)
    assert probe(directory, int_block_hash(2), TOTAL, 1)
    assert list_whole(directory, TOTAL) == [int_block_hash(2)]
    with pytest.raises(BlockLoadError, match="not stored"):
        read(engine(tmp_path, 4)[0], 1)


def test_a_corrupt_head_fails_only_the_reads_of_that_head_and_the_file_goes(
    tmp_path: Path,
) -> None:
    write(engine(tmp_path, 4), 5)
    path = path_of(tmp_path, 5, HeadGroup(0, 4))
    data = bytearray(path.read_bytes())
    data[header_size(4) + 3 * PAGES * PIECE + 1] ^= 1  # head 3
    path.write_bytes(data)
    low, high = engine(tmp_path, 2)
    assert read(low, 5) == row(5, low.group)  # heads 0-1: their checksums hold
    with pytest.raises(BlockLoadError, match="corrupt"):
        read(high, 5)
    assert not path.exists()
    assert high.stats().checksum_failures == 1
    assert high.take_dropped() == [int_block_hash(5)]


def test_a_same_layout_reader_refuses_a_corrupt_file_and_falls_back_to_another_grouping(
    tmp_path: Path,
) -> None:
    write(engine(tmp_path, 1), 6)
    write(engine(tmp_path, 4), 6)
    path = path_of(tmp_path, 6, HeadGroup(0, 4))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    (whole,) = engine(tmp_path, 4)
    assert read(whole, 6) == row(6, HeadGroup(0, 4))  # from the one-head files
    assert not path.exists()


def test_a_longer_or_torn_own_file_is_refused(tmp_path: Path) -> None:
    (store,) = engine(tmp_path, 4)
    write([store], 1)
    write([store], 2)
    with path_of(tmp_path, 1, HeadGroup(0, 4)).open("ab") as file:
        file.write(b"x")
    torn = path_of(tmp_path, 2, HeadGroup(0, 4))
    torn.write_bytes(torn.read_bytes()[:-5])
    for block in (1, 2):
        with pytest.raises(BlockLoadError):
            read(store, block)


def test_each_engine_evicts_only_the_files_it_wrote(tmp_path: Path) -> None:
    first, second = engine(tmp_path, 4, fsync=False), engine(tmp_path, 4, fsync=False)
    write(first, 1)
    write(second, 2)
    second[0].discard([int_block_hash(1), int_block_hash(2)])
    assert path_of(tmp_path, 1, HeadGroup(0, 4)).exists()  # the first engine's
    assert not path_of(tmp_path, 2, HeadGroup(0, 4)).exists()
    assert read(second[0], 1) == row(1, HeadGroup(0, 4))  # read all the same
    assert second[0].stats().used_bytes == 0


def test_a_store_owns_what_it_wrote_within_its_budget(tmp_path: Path) -> None:
    (store,), (other,) = engine(tmp_path, 4, blocks=2), engine(tmp_path, 4, blocks=2)
    write([store], 1)
    write([store], 2)
    with pytest.raises(OSError, match="full"):
        write([store], 3)
    write([other], 3)  # its budget is its own
    assert int_block_hash(3) in other and int_block_hash(3) not in store


def test_reopening_adopts_its_groups_files_newest_first_up_to_its_budget(tmp_path: Path) -> None:
    workers = engine(tmp_path, 2)
    for block in range(4):
        write(workers, block)
        for group in (HeadGroup(0, 2), HeadGroup(2, 2)):
            os.utime(path_of(tmp_path, block, group), ns=(block * 10**9, block * 10**9))
    for store in engine(tmp_path, 2, blocks=3):
        assert store.recovered == [int_block_hash(b) for b in (1, 2, 3)]  # oldest first
        assert store.stats().used_bytes == 3 * store.file_bytes
    (whole,) = engine(tmp_path, 4)
    assert whole.recovered == []  # no file of its grouping


def test_recovery_leaves_a_young_temp_file_and_deletes_an_old_one(tmp_path: Path) -> None:
    directory = shared_directory(tmp_path, SHARED)
    engine(tmp_path, 4)
    young = directory / (file_name(int_block_hash(1), HeadGroup(0, 4)) + ".aaaa-0.tmp")
    old = directory / (file_name(int_block_hash(2), HeadGroup(0, 4)) + ".bbbb-0.tmp")
    young.write_bytes(b"in flight")
    old.write_bytes(b"abandoned")
    os.utime(old, (1_000.0, 1_000.0))
    (store,) = engine(tmp_path, 4, clock=lambda: 1_000.0 + 601.0)
    assert young.exists() and not old.exists()
    assert store.stats().dropped_at_recovery == 1


def test_concurrent_writers_of_one_block_leave_one_whole_file(tmp_path: Path) -> None:
    writers = [engine(tmp_path, 4, fsync=False)[0] for _ in range(4)]
    barrier = threading.Barrier(len(writers))

    def run(store: SharedDiskStore) -> None:
        barrier.wait()
        for _ in range(25):
            store.write([int_block_hash(9)], [row(9, store.group)])

    threads = [threading.Thread(target=run, args=(store,)) for store in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    directory = shared_directory(tmp_path, SHARED)
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["layout.json", file_name(int_block_hash(9), HeadGroup(0, 4))]
    )
    for store in engine(tmp_path, 1):
        assert read(store, 9) == row(9, store.group)


def test_a_single_owner_store_on_the_same_root_is_unaffected(tmp_path: Path) -> None:
    engine(tmp_path, 2)
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_size=8, block_size=4)
    store = DiskStore(tmp_path, layout, DiskStore.capacity_for(layout, 4))  # no mismatch
    store.write([int_block_hash(1)], [bytes(layout.bytes_per_block)])
    store.close()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    layout = row_layout(2)
    with pytest.raises(ValueError, match="not a group"):
        SharedDiskStore(tmp_path, SHARED, layout, TOTAL, HeadGroup(3, 2), 1 << 20)
    with pytest.raises(ValueError, match="not 3 heads"):
        SharedDiskStore(tmp_path, SHARED, layout, 6, HeadGroup(0, 3), 1 << 20)
    with pytest.raises(ValueError, match="below one block file"):
        SharedDiskStore(tmp_path, SHARED, layout, TOTAL, HeadGroup(0, 2), 10)
    with pytest.raises(ValueError, match="temp_max_age_s"):
        SharedDiskStore(tmp_path, SHARED, layout, TOTAL, HeadGroup(0, 2), 1 << 20, temp_max_age_s=0)


def test_a_worker_that_does_not_write_reads_the_writers_file(tmp_path: Path) -> None:
    layout = row_layout(1)
    capacity = 1 << 20
    writer = SharedDiskStore(tmp_path, SHARED, layout, TOTAL, HeadGroup(1, 1), capacity)
    twin = SharedDiskStore(tmp_path, SHARED, layout, TOTAL, HeadGroup(1, 1), capacity, writes=False)
    twin.write([int_block_hash(4)], [row(4, twin.group)])
    assert not path_of(tmp_path, 4, HeadGroup(1, 1)).exists()
    writer.write([int_block_hash(4)], [row(4, writer.group)])
    assert read(twin, 4) == row(4, HeadGroup(1, 1))
