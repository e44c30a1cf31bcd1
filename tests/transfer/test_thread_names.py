"""kvtier's threads carry their own names in the kernel's lists (`kvtier.thread_names`),
so that a side's CPU can be split by thread (`bench_serving`'s `server_cpu_by_thread`)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.store.memory import MemoryStore
from kvtier.thread_names import MAX_NAME_BYTES, name_native_thread
from kvtier.transfer.transfer_worker import TransferWorker
from tests.transfer.helpers import LAYOUTS, random_kv

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def native_names() -> set[str]:
    return {p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm")}


def test_a_thread_takes_the_name_and_a_long_one_is_cut_to_what_linux_keeps() -> None:
    names: list[str] = []

    def body(name: str) -> None:
        assert name_native_thread(name)
        names.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text())

    for name in ("kv-test", "kv-a-name-longer-than-fifteen"):
        thread = threading.Thread(target=body, args=(name,))
        thread.start()
        thread.join()
    assert names == ["kv-test\n", "kv-a-name-longer-than-fifteen"[:MAX_NAME_BYTES] + "\n"]
    with pytest.raises(ValueError, match="must not be empty"):
        name_native_thread("")


def test_a_transfer_workers_threads_are_named_for_their_tier_and_role() -> None:
    kv = random_kv(LAYOUTS[0], num_blocks=4, seed=1)
    with TransferWorker.for_store(kv, MemoryStore(LAYOUTS[0], 4), name="cpu") as worker:
        # a job on each thread: each has named itself before it took one
        assert worker.submit_store(1, [0], CPULoadStoreSpec([0]))
        assert worker.wait([1])
        assert worker.submit_load(2, CPULoadStoreSpec([0]), [1])
        assert worker.wait([2])
        assert {"kv-cpu-store", "kv-cpu-load"} <= native_names()
    assert not {"kv-cpu-store", "kv-cpu-load"} & native_names()  # closed: gone
