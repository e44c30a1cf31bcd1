"""Model-based test of a transfer worker over the memory tier: random stores and loads
between random device blocks and slots, several jobs in flight; every finished load
must hold exactly the bytes the model says its slots hold, and results must come back
in submission order per direction."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.store.memory import MemoryStore
from kvtier.transfer.transfer_worker import TransferWorker
from tests.transfer.helpers import CROSS_LAYER, PER_LAYER, block_bytes, random_kv

SLOTS = 8
SOURCES = 8  # device blocks 0..7 hold fixed random data; loads land in 8..15


class WorkerMachine(RuleBasedStateMachine):
    @initialize(per_layer=st.booleans())
    def start(self, per_layer: bool) -> None:
        layout = PER_LAYER if per_layer else CROSS_LAYER
        self.kv = random_kv(layout, 2 * SOURCES, seed=5)
        self.sources = [block_bytes(self.kv, i) for i in range(SOURCES)]
        self.worker = TransferWorker.for_store(
            self.kv, MemoryStore(layout, SLOTS), max_queued_jobs=64
        )
        self.slots: dict[int, bytes] = {}  # what each slot holds (finished stores)
        self.pending: dict[int, dict[int, bytes]] = {}  # store job -> what it writes
        self.expect: dict[int, list[tuple[int, bytes]]] = {}  # load job -> (target, bytes)
        self.order: dict[str, list[int]] = {"store": [], "load": []}
        self.next_job = 0

    def teardown(self) -> None:
        if hasattr(self, "worker"):
            self.drain()
            self.worker.close()

    def _job(self) -> int:
        self.next_job += 1
        return self.next_job

    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(1, 4))
        devices = data.draw(st.lists(st.integers(0, SOURCES - 1), min_size=n, max_size=n))
        slots = data.draw(st.lists(st.integers(0, SLOTS - 1), unique=True, min_size=n, max_size=n))
        # A slot being loaded is pinned, and a slot is loadable only once its store
        # finished (the scheduler's two-phase protocol): queued loads finish first.
        if self.expect:
            self.drain()
        job = self._job()
        assert self.worker.submit_store(job, devices, CPULoadStoreSpec(slots))
        self.pending[job] = {s: self.sources[d] for s, d in zip(slots, devices, strict=True)}
        self.order["store"].append(job)

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        being_stored = {slot for stored in self.pending.values() for slot in stored}
        loadable = sorted(set(self.slots) - being_stored)  # a slot in flight is not readable
        if not loadable:
            return
        slots = data.draw(st.lists(st.sampled_from(loadable), unique=True, max_size=4))
        targets = data.draw(
            st.lists(
                st.integers(SOURCES, 2 * SOURCES - 1),
                unique=True,
                min_size=len(slots),
                max_size=len(slots),
            )
        )
        busy = {t for pairs in self.expect.values() for t, _ in pairs}
        if busy & set(targets):
            self.drain()
        job = self._job()
        assert self.worker.submit_load(job, CPULoadStoreSpec(slots), targets)
        self.expect[job] = [(t, self.slots[s]) for t, s in zip(targets, slots, strict=True)]
        self.order["load"].append(job)

    @rule()
    def drain(self) -> None:
        outstanding = self.order["store"] + self.order["load"]
        assert self.worker.wait(outstanding, timeout=60)
        finished = self.worker.get_finished()
        for direction, jobs in self.order.items():
            seen = [r.job_id for r in finished if r.job_id in set(jobs)]
            assert seen == jobs, (direction, seen, jobs)  # submission order per direction
            self.order[direction] = []
        for result in finished:
            stored = self.pending.pop(result.job_id, None)
            if stored is not None and result.ok:
                self.slots.update(stored)
            pairs = self.expect.pop(result.job_id, None)
            if pairs is not None and result.ok:
                for target, expected in pairs:
                    assert block_bytes(self.kv, target) == expected
        assert not self.expect


TestWorkerModel = WorkerMachine.TestCase
TestWorkerModel.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
