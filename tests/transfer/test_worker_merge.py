"""Jobs queued behind a busy worker thread run as one copy, and still report one by one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.store.memory import MemoryStore
from kvtier.transfer.transfer_worker import TransferWorker
from tests.transfer.helpers import LAYOUTS, block_bytes, random_kv


class Gate:
    """Wraps a handler method: records each call's block count; the first call waits
    until released, so the jobs submitted meanwhile queue up behind it."""

    def __init__(self, method: Callable[..., int], ids_arg: int) -> None:
        self.method, self.ids_arg = method, ids_arg
        self.calls: list[int] = []
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, *args: Any) -> int:
        self.calls.append(len(args[self.ids_arg]))
        if len(self.calls) == 1:
            self.entered.set()
            assert self.release.wait(timeout=30)
        return self.method(*args)


def _gated(worker: TransferWorker, name: str) -> Gate:
    handler: Any = worker.handler
    gate = Gate(getattr(handler, name), ids_arg=0 if name == "store" else 1)
    setattr(handler, name, gate)
    return gate


@pytest.mark.parametrize("layout", LAYOUTS, ids=["per_layer", "cross_layer"])
def test_queued_stores_and_loads_run_as_one_copy_each(layout: Any) -> None:
    kv = random_kv(layout, num_blocks=24, seed=11)
    size = layout.bytes_per_block
    with TransferWorker.for_store(kv, MemoryStore(layout, 12)) as worker:
        gate = _gated(worker, "store")
        worker.submit_store(0, [0], CPULoadStoreSpec([0]))
        assert gate.entered.wait(timeout=30)  # the thread now holds job 0
        for job in range(1, 5):  # slots 1..8 from device blocks 7, 5, 3, ... (scattered)
            worker.submit_store(
                job, [9 - 2 * job, 10 - 2 * job], CPULoadStoreSpec([2 * job - 1, 2 * job])
            )
        gate.release.set()
        worker.wait(range(5))
        stores = worker.get_finished()
        assert gate.calls == [1, 8]  # the four queued jobs: one copy
        assert [(r.job_id, r.ok, r.bytes) for r in stores] == [
            (0, True, size),
            *[(job, True, 2 * size) for job in range(1, 5)],
        ]
        load_gate = _gated(worker, "load")
        worker.submit_load(10, CPULoadStoreSpec([0]), [12])
        assert load_gate.entered.wait(timeout=30)
        for job in range(1, 5):
            worker.submit_load(
                10 + job, CPULoadStoreSpec([2 * job - 1, 2 * job]), [12 + job * 2 - 1, 12 + job * 2]
            )
        load_gate.release.set()
        worker.wait(range(10, 15))
        loads = worker.get_finished()
    assert load_gate.calls == [1, 8] and all(r.ok for r in loads)
    assert [r.job_id for r in loads] == list(range(10, 15))
    assert block_bytes(kv, 12) == block_bytes(kv, 0)
    for job in range(1, 5):  # device 9-2j went to slot 2j-1 and came back to 12+2j-1
        assert block_bytes(kv, 12 + 2 * job - 1) == block_bytes(kv, 9 - 2 * job)
        assert block_bytes(kv, 12 + 2 * job) == block_bytes(kv, 10 - 2 * job)


def test_a_failing_merged_run_is_retried_job_by_job() -> None:
    layout = LAYOUTS[0]
    kv = random_kv(layout, num_blocks=8, seed=12)
    with TransferWorker.for_store(kv, MemoryStore(layout, 8)) as worker:
        gate = _gated(worker, "store")
        real = gate.method

        def fails_on_block_5(ids: np.ndarray, spec: Any, ready: Any) -> int:
            if 5 in ids.tolist():
                raise OSError("device block 5 unreadable")
            return real(ids, spec, ready)

        gate.method = fails_on_block_5
        worker.submit_store(0, [0], CPULoadStoreSpec([0]))
        assert gate.entered.wait(timeout=30)
        worker.submit_store(1, [1, 2], CPULoadStoreSpec([1, 2]))
        worker.submit_store(2, [5], CPULoadStoreSpec([3]))
        worker.submit_store(3, [6], CPULoadStoreSpec([4]))
        gate.release.set()
        worker.wait(range(4))
        results = worker.get_finished()
        errors = list(worker.errors)
    assert [(r.job_id, r.ok) for r in results] == [(0, True), (1, True), (2, False), (3, True)]
    assert gate.calls == [1, 4, 2, 1, 1]  # merged, failed, then each job alone
    assert [job for job, _ in errors] == [2]  # only the job that fails alone is blamed


def test_jobs_sharing_a_slot_or_without_blocks_are_not_merged() -> None:
    layout = LAYOUTS[1]
    kv = random_kv(layout, num_blocks=8, seed=13)
    with TransferWorker.for_store(kv, MemoryStore(layout, 8)) as worker:
        gate = _gated(worker, "store")
        worker.submit_store(0, [0], CPULoadStoreSpec([0]))
        assert gate.entered.wait(timeout=30)
        worker.submit_store(1, [1], CPULoadStoreSpec([5]))
        worker.submit_store(2, [2], CPULoadStoreSpec([5]))  # same slot: the later write wins
        gate.release.set()
        worker.wait(range(3))
        assert gate.calls == [1, 1, 1]
        worker.submit_load(3, CPULoadStoreSpec([5]), [6])
        empty = [worker.submit_load(4 + i, CPULoadStoreSpec([]), []) for i in range(3)]
        worker.wait(range(7))
        results = worker.get_finished()
    assert all(empty) and all(r.ok for r in results) and len(results) == 7
    assert block_bytes(kv, 6) == block_bytes(kv, 2)
