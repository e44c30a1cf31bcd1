"""Model-based test of kvtier's worker and scheduler side (as `KvtierConnector` builds
them) over a CPU tier and a disk whose writes can hang: whatever the interleaving of
stores, loads, resets and a disk that stops and goes on,

- vLLM's flush of a store and every load return while the disk hangs (no store holds
  the engine's blocks or a load back on a disk write);
- a load delivers exactly the bytes stored under its keys, or reports the block for
  recompute;
- the local store queue counts what its stores hold (their demotions' host rows too):
  never more than its bound or one store's, and nothing once every job is done.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.vllm.offloading.job_specs import LOCAL, REMOTE
from tests.vllm.test_offloading_spec import BLOCK_BYTES, Engine, keys_of

STORE_IDS = 8  # device blocks 0-7 hold what stores read; loads write into 8-15
HANG_S = 20.0  # a write held this long with nobody letting it go: something waited on it


class WorkerMachine(RuleBasedStateMachine):
    @initialize(
        disk_writes=st.sampled_from(["demote", "write_through"]),
        queue_blocks=st.integers(1, 6),
    )
    def start(self, disk_writes: str, queue_blocks: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvtier-worker-model-"))
        self.cap = queue_blocks * BLOCK_BYTES
        self.engine = Engine(
            {
                "cpu_bytes_to_use": 3 * BLOCK_BYTES,
                "disk_path": str(self.root),
                "disk_bytes_to_use": 24 * (BLOCK_BYTES + 128),
                "disk_writes": disk_writes,
                "disk_store_queue_bytes": self.cap,
            }
        )
        self.gate = threading.Event()
        self.gate.set()
        self.stuck = 0  # writes that waited HANG_S with the disk hung: someone waited on one
        assert self.engine.worker.disk is not None
        self.engine.worker.disk.io_hook = self._hook
        self.keys = itertools.count(1000, 4)  # (a store takes at most 3 fresh keys)
        self.jobs = itertools.count()
        self.seed = itertools.count()
        self.data: dict[bytes, bytes] = {}  # every key stored in this epoch: its bytes
        self.pending: dict[int, list[bytes]] = {}  # store jobs of this epoch not completed
        self.next_id = 0

    def _hook(self, kind: str) -> None:
        if kind == "write" and not self.gate.wait(HANG_S):
            self.stuck += 1

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            self.gate.set()
            self.engine.close()
            shutil.rmtree(self.root, ignore_errors=True)

    # --- the scheduler's side of finished jobs ---------------------------------------

    def _collect(self) -> dict[int, bool]:
        """Finished jobs, as the connector hears of them: the report first, then each
        store completed in the scheduler (loads are completed by their rule)."""
        engine = self.engine
        results = {r.job_id: r.success for r in engine.worker.get_finished()}
        report = engine.worker.take_report()
        if report.worth_sending():
            engine.manager.apply_worker_report(report)
        for job in [j for j in results if j in self.pending]:
            engine.manager.complete_store(self.pending.pop(job), engine.ctx)
        return results

    # --- rules -------------------------------------------------------------------------

    @rule(n=st.integers(1, 3))
    def store(self, n: int) -> None:
        engine = self.engine
        keys = keys_of(n, start=next(self.keys))
        ids = [(self.next_id + i) % STORE_IDS for i in range(n)]
        self.next_id += n
        data = engine.compute(ids, seed=next(self.seed))
        out = engine.manager.prepare_store(keys, engine.ctx)
        if out is None or not out.keys_to_store:
            return
        stored = list(out.keys_to_store)
        device = [ids[keys.index(k)] for k in stored]
        job = next(self.jobs)
        gpu = GPULoadStoreSpec(device, [len(device)], [0])
        engine.worker.submit_store(job, gpu, out.store_spec)
        engine.worker.wait({job})  # vLLM's flush: never waits for the disk
        self.pending[job] = stored
        self.data.update((k, data[ids[keys.index(k)]]) for k in stored)

    @rule(pick=st.integers(0, 10**6), n=st.integers(1, 3), disk_only=st.booleans())
    def load(self, pick: int, n: int, disk_only: bool) -> None:
        """`disk_only`: from a block the CPU tier lacks (promoted into a full CPU tier, it
        demotes another: a write apart, no job's, counted in the queue)."""
        engine = self.engine
        self._collect()  # (the step's finished stores first, as vLLM completes them)
        if not self.data:
            return
        stored = [k for k in self.data if engine.hits([k])]  # (a load starts at a hit)
        if disk_only:
            stored = [k for k in stored if not self._in_cpu(k)]
        if not stored:
            return
        start = pick % len(stored)
        keys = stored[start : start + n]
        keys = keys[: engine.hits(keys)]
        if not keys:
            return
        spec = engine.manager.prepare_load(keys, engine.ctx)
        job = next(self.jobs)
        ids = list(range(STORE_IDS, STORE_IDS + len(keys)))
        engine.worker.submit_load(job, spec, GPULoadStoreSpec(ids, [len(ids)], [0]))
        engine.worker.wait_finished({job})  # never waits for the disk's writes either
        finished = self._collect()
        assert finished.get(job) is True  # failures go to the report, not the result
        errors = engine.worker.take_load_errors()
        engine.manager.complete_load(set(keys), engine.ctx)
        for key, device in zip(keys, ids, strict=True):
            if device not in errors:
                assert engine.block_bytes(device) == self.data[key], key.hex()

    def _in_cpu(self, key: bytes) -> bool:
        local = self.engine.manager.local
        assert isinstance(local, CascadeOffloadingManager)
        block = local._cpu_core.get_block(self.engine.manager._hash_of(key))
        return block is not None

    @rule()
    def settle(self) -> None:
        self._collect()

    @rule()
    def hang(self) -> None:
        self.gate.clear()

    @rule()
    def go_on(self) -> None:
        self.gate.set()

    @rule()
    def reset(self) -> None:
        """vLLM drops the jobs of before the reset (never completing them) and forgets
        what they stored."""
        self.engine.manager.reset_cache()
        self.pending.clear()
        self.data.clear()

    @rule()
    def drain(self) -> None:
        """The disk goes on and every job ends: the queue holds nothing any more."""
        worker = self.engine.worker
        self.gate.set()
        assert worker._wait_writes(lambda tier, sub: True, timeout=60)
        self._collect()
        assert worker._store_queued == {LOCAL: 0, REMOTE: 0}, worker._store_queued
        handler = worker._handler
        assert handler is not None and not handler._staged_demotions

    # --- invariants --------------------------------------------------------------------

    @invariant()
    def nothing_waited_on_a_hung_disk(self) -> None:
        if hasattr(self, "engine"):
            assert self.stuck == 0

    @invariant()
    def the_queue_counts_the_staged_demotions_within_its_bound(self) -> None:
        if not hasattr(self, "engine"):
            return
        worker = self.engine.worker
        handler = worker._handler
        assert handler is not None
        with worker._lock:
            queued = worker._store_queued[LOCAL]
        staged = sum(handler._staged_demotions.values()) * BLOCK_BYTES
        # (an empty queue takes any store: 3 blocks and the 3 they demote; past that, no
        # store nor load's demotion takes the queue over its bound)
        one_store = 6 * BLOCK_BYTES
        assert staged <= queued or not staged, (staged, queued)
        assert queued <= max(self.cap, one_store), (queued, self.cap)


TestWorker = WorkerMachine.TestCase
TestWorker.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
