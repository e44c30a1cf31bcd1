"""One owner per disk tier directory (issue 15 item 5), tested with real processes.

Two stores on one directory used to corrupt each other: the second's recovery deleted
the first's in-flight temporary files, a smaller second budget deleted the first's
blocks, and two budgets of N left 2N files. Now the second opener is refused, naming
the directory and the holder's pid, and leaves every file as it was. The processes
synchronize through pipes (no sleeps): the child says "ready" once it holds the
directory and waits for a line on stdin before it closes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.store.disk_store import DiskStore
from kvtier.store.diskdir import DirectoryInUseError, reclaim_abandoned
from kvtier.store.diskformat import file_name
from kvtier.store.layout import KVLayout
from kvtier.types import int_block_hash

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_size=8, block_size=4, dtype="float16")
CAPACITY = DiskStore.capacity_for(LAYOUT, 50)

OWNER = """
import sys
from kvtier.store.disk_store import DiskStore
from kvtier.store.layout import KVLayout
from kvtier.types import int_block_hash

layout = KVLayout(num_layers=2, num_kv_heads=1, head_size=8, block_size=4, dtype="float16")
store = DiskStore(sys.argv[1], layout, int(sys.argv[2]))
hashes = [int_block_hash(i) for i in range(50)]
store.write(hashes, [bytes([i]) * layout.bytes_per_block for i in range(50)])
print("ready", flush=True)
sys.stdin.readline()
store.close()
print("closed", flush=True)
sys.stdin.readline()
"""


def start_owner(root: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(root), str(CAPACITY)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    return child


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_second_process_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    child = start_owner(tmp_path)
    assert child.stdin is not None and child.stdout is not None
    try:
        directory = next(tmp_path.glob("kvtier-*"))
        # A write of the owner's in flight: the refused opener must not touch it.
        (directory / (file_name(int_block_hash(99)) + f".{child.pid}-7.tmp")).write_bytes(b"hal")
        before = snapshot(directory)
        for capacity in (CAPACITY, DiskStore.capacity_for(LAYOUT, 10)):  # smaller budget too
            with pytest.raises(DirectoryInUseError) as refused:
                DiskStore(tmp_path, LAYOUT, capacity)
            assert str(directory) in str(refused.value)
            assert f"in use by process {child.pid} " in str(refused.value)
        assert snapshot(directory) == before  # 50 blocks and the temp file, all there
        child.stdin.write("close\n")
        child.stdin.flush()
        assert child.stdout.readline() == "closed\n"
        # The owner closed (its process still alive): the directory is free again.
        store = DiskStore(tmp_path, LAYOUT, CAPACITY)
        assert len(store.recovered) == 50
        store.close()
    finally:
        child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()


def test_a_killed_owner_leaves_the_directory_free(tmp_path: Path) -> None:
    child = start_owner(tmp_path)
    child.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel drops the lock
    child.wait()
    assert child.stdin is not None and child.stdout is not None
    child.stdin.close()
    child.stdout.close()
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    assert len(store.recovered) == 50
    store.close()


def test_one_process_two_stores_and_the_closed_store(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    with pytest.raises(DirectoryInUseError, match=rf"process {os.getpid()} \(this process\)"):
        DiskStore(tmp_path, LAYOUT, CAPACITY)
    store.write([int_block_hash(1)], [bytes(LAYOUT.bytes_per_block)])
    store.close()
    with pytest.raises(DirectoryInUseError, match="was closed"):
        store.write([int_block_hash(2)], [bytes(LAYOUT.bytes_per_block)])
    again = DiskStore(tmp_path, LAYOUT, CAPACITY)
    assert again.recovered == [int_block_hash(1)]
    again.close()


def test_reclaim_deletes_only_directories_whose_owner_is_gone(tmp_path: Path) -> None:
    live, dead, fresh = (tmp_path / f"run-{name}" for name in ("live", "dead", "fresh"))
    store = DiskStore(live, LAYOUT, CAPACITY)
    DiskStore(dead, LAYOUT, CAPACITY).close()  # as a SIGKILL leaves it: lock free
    fresh.mkdir()  # created, its store not open yet: no lock file, kept
    (tmp_path / "other").mkdir()
    assert reclaim_abandoned(tmp_path, "run-") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "run-fresh", "run-live"]
    store.close()
