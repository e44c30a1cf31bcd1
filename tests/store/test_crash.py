"""SIGKILL a process that is storing blocks, at random points, over and over.

After every kill the directory is reopened: every block whose store had returned
before the kill must be there, byte-identical, and nothing else may be served but
intact blocks. The child reports a block only after `write` returned, so the set it
reported is exactly the set of completed stores the kill may not lose.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.store.disk_store import DiskStore
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError
from kvtier.types import int_block_hash

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_size=64, block_size=16, dtype="float16")
CAPACITY = DiskStore.capacity_for(LAYOUT, 4096)
ITERATIONS = 12

CHILD = """
import random, sys
from kvtier.store.disk_store import DiskStore
from kvtier.store.layout import KVLayout
from kvtier.types import int_block_hash

layout = KVLayout(num_layers=4, num_kv_heads=2, head_size=64, block_size=16, dtype="float16")
root, first, capacity = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = DiskStore(root, layout, capacity, parallel_min_bytes=0)  # batches on 2 threads
i = first
while True:
    batch = list(range(i, i + 1 + i % 3))
    store.write(
        [int_block_hash(b) for b in batch],
        [random.Random(b).randbytes(layout.bytes_per_block) for b in batch],
    )
    print(*batch, flush=True)
    i = batch[-1] + 1
"""


def expected(block: int) -> bytes:
    return random.Random(block).randbytes(LAYOUT.bytes_per_block)


def run_and_kill(root: Path, first: int, kill_after: int) -> list[int]:
    """Start a storing child, SIGKILL it after `kill_after` completed batches."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), str(first), str(CAPACITY)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    completed: list[int] = []
    for _ in range(kill_after):
        line = child.stdout.readline()
        assert line, f"child exited early with {child.wait()}"
        completed.extend(int(b) for b in line.split())
    child.send_signal(signal.SIGKILL)  # lands somewhere inside the next batch
    child.wait()
    completed.extend(int(b) for b in child.stdout.read().split())  # reported before death
    child.stdout.close()
    return completed


@pytest.mark.slow
def test_sigkill_at_random_points_keeps_every_completed_block(tmp_path: Path) -> None:
    rng = random.Random(20261120)
    completed: set[int] = set()
    next_block = 0
    for iteration in range(ITERATIONS):
        completed.update(run_and_kill(tmp_path, next_block, kill_after=rng.randint(1, 6)))
        store = DiskStore(tmp_path, LAYOUT, CAPACITY)
        recovered = {int.from_bytes(h, "big") for h in store.recovered}
        assert completed <= recovered, f"iteration {iteration}: lost {completed - recovered}"
        buffer = bytearray(LAYOUT.bytes_per_block)
        for block in sorted(recovered):
            try:
                store.read([int_block_hash(block)], [memoryview(buffer)])
            except BlockLoadError:
                assert block not in completed
                continue
            assert bytes(buffer) == expected(block), f"block {block} served torn"
        assert not list(store.directory.glob("*.tmp"))
        store.close()  # the next child owns the directory
        next_block = max(recovered | completed) + 1
    assert len(completed) >= ITERATIONS
