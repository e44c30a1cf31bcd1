"""Loads run at a raised priority where the process may raise it, and only loads."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence

import pytest

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.transfer import thread_priority
from kvtier.transfer.handlers import StagedHandler
from kvtier.transfer.thread_priority import LOAD_NICE, load_priority
from kvtier.transfer.transfer_worker import TransferWorker
from tests.transfer.helpers import PER_LAYER, DictStore, hashes, random_kv

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="thread priorities are set on Linux only"
)


class FakeNice:
    """Each thread's nice value, as the kernel would keep it; refuses raises when told."""

    def __init__(self) -> None:
        self.nice: dict[int, int] = {}
        self.refuse = False
        self.raises = 0

    def get(self, which: int, who: int) -> int:
        assert which == os.PRIO_PROCESS
        return self.nice.get(who, 0)

    def set(self, which: int, who: int, value: int) -> None:
        assert which == os.PRIO_PROCESS
        if value < self.get(which, who):
            self.raises += 1
            if self.refuse:
                raise PermissionError(1, "Operation not permitted")
        self.nice[who] = value

    def mine(self) -> int:
        return self.nice.get(threading.get_native_id(), 0)


@pytest.fixture
def nice(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNice]:
    fake = FakeNice()
    monkeypatch.setattr(os, "getpriority", fake.get)
    monkeypatch.setattr(os, "setpriority", fake.set)
    thread_priority._denied.clear()
    yield fake
    thread_priority._denied.clear()


def test_the_body_runs_raised_and_the_priority_is_put_back(nice: FakeNice) -> None:
    nice.nice[threading.get_native_id()] = 5
    with load_priority() as raised:
        assert raised is True
        assert nice.mine() == LOAD_NICE
    assert nice.mine() == 5


def test_a_thread_already_as_high_is_left_alone(nice: FakeNice) -> None:
    nice.nice[threading.get_native_id()] = -15
    with load_priority() as raised:
        assert raised is False
        assert nice.mine() == -15
    assert nice.raises == 0


def test_a_refusal_is_logged_once_and_not_asked_again(
    nice: FakeNice, caplog: pytest.LogCaptureFixture
) -> None:
    nice.refuse = True
    with caplog.at_level(logging.INFO, logger=thread_priority.__name__):
        for _ in range(3):
            with load_priority() as raised:
                assert raised is False
                assert nice.mine() == 0
    assert nice.raises == 1
    assert sum("refused" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("value", [-21, 20])
def test_a_nice_value_out_of_range_is_refused(value: int) -> None:
    refused = pytest.raises(ValueError, match=f"nice={value}; a nice value is between -20 and 19")
    with refused, load_priority(value):
        pass


class PriorityStore(DictStore):
    """Records the nice value of the thread each write and read runs at."""

    def __init__(self, nice: FakeNice) -> None:
        super().__init__(PER_LAYER)
        self._nice = nice
        self.seen: list[tuple[str, int]] = []

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        self.seen.append(("store", self._nice.mine()))
        super().write_blocks(spec, blocks)

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        self.seen.append(("load", self._nice.mine()))
        super().read_blocks(spec, blocks)


@pytest.mark.parametrize("ordered", [False, True])
def test_a_worker_raises_its_loads_not_its_stores(nice: FakeNice, ordered: bool) -> None:
    """Both a worker with a thread per direction and the cascade's ordered one (a single
    thread serving both) run loads raised and stores at the thread's own priority."""
    kv = random_kv(PER_LAYER, num_blocks=8, seed=3)
    store = PriorityStore(nice)
    with TransferWorker(StagedHandler(kv, store), ordered=ordered) as worker:
        worker.submit_store(1, [0], hashes(1))
        worker.wait([1])
        worker.submit_load(2, hashes(1), [4])
        worker.wait([2])
        worker.submit_store(3, [1], hashes(2))
        worker.wait([3])
        results = {r.job_id: r.ok for r in worker.get_finished()}
    assert results == {1: True, 2: True, 3: True}
    assert store.seen == [("store", 0), ("load", LOAD_NICE), ("store", 0)]


def test_the_kernel_raises_and_restores_a_real_thread() -> None:
    """Where this process may raise a thread's priority (root, CAP_SYS_NICE), a real
    thread runs its body at LOAD_NICE and gets its own value back."""
    thread_priority._denied.clear()
    seen: dict[str, object] = {}

    def body() -> None:
        tid = threading.get_native_id()
        seen["before"] = os.getpriority(os.PRIO_PROCESS, tid)
        with load_priority() as raised:
            seen["raised"] = raised
            seen["during"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, tid)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    thread_priority._denied.clear()
    if not seen["raised"]:
        pytest.skip("this process may not raise a thread's priority")
    assert seen["during"] == LOAD_NICE
    assert seen["after"] == seen["before"]
