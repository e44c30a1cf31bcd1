"""Asynchronous transfer worker: one per medium, driven by the scheduler loop.

API (vLLM's offloading-worker shape):

- `submit_store(job_id, device_block_ids, dst_spec)`: copy device blocks out to the
  medium slots/keys named by `dst_spec` (from the medium's offloading `Backend`).
- `submit_load(job_id, src_spec, device_block_ids)`: copy blocks back in.
- `get_finished() -> [TransferResult(job_id, ok, bytes, seconds)]`: results since
  the last call; unpacks as a 4-tuple.
- `wait(job_ids)`: block until those jobs have finished (results stay queued for
  `get_finished`).
- `submit_discard(job_id, block_hashes)`: delete blocks from a medium that keeps
  them by hash (the disk), in order with the stores.
- `submit_write(job_id, spec)`: a store that reads no device block (`handler.write`:
  the cascade's write-through, from the CPU slots a store just filled), on a thread of
  its own in submission order among writes, its result released in that order: so
  neither a later store's copy nor vLLM's flush of its device blocks waits for a slow
  disk. The handler orders a write after the copy it writes out.

Why this shape: the scheduler must never block on bytes, and must never see an
exception from a medium. So each direction has one thread and a bounded queue; a
submission to a full queue, a medium error or a checksum failure all become a
failed result (`ok=False`), and the scheduler answers with
`complete_store(..., success=False)` or treats the load as a miss. Results are
released in submission order per direction (a rejected job waits for the jobs
submitted before it), so a store completes only after every earlier store of the
same worker. Threads suffice: torch copies, file I/O, hashing and sockets all
release the GIL. A medium whose stores wait on round trips (Redis across a network)
may have several store threads (`store_threads`): with one, a link adding 200 ms a
round trip sent at most five store jobs a second, and the CPU slots a Redis store is
sent from stay pinned until it is. Results stay in submission order.

Jobs that queue up behind a busy thread are run as one when the handler can merge
their specs (the memory tier): one copy per segment over all of them instead of one
per job, which is what lets a backlog of small jobs run at the speed of big copies.
Each job still gets its own result, in order; if a merged run fails, its jobs run
again one by one, so only the jobs that fail alone are reported failed.

Plugging in a medium: anything implementing `kvtier.store.protocol.BlockStore`
(`layout`, `write_blocks(spec, blocks)`, `read_blocks(spec, blocks)`) gets a worker
from `TransferWorker.for_store(kv, store)`; the memory tier's `MemoryStore` gets the
direct-copy handler.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol, cast

import numpy as np
import numpy.typing as npt

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.store.memory import MemoryStore
from kvtier.store.protocol import BlockStore
from kvtier.thread_names import name_native_thread
from kvtier.transfer.device import DeviceKV, leave_compute_cores, limit_torch_threads
from kvtier.transfer.handlers import HostSlotHandler, StagedHandler, TransferHandler
from kvtier.transfer.thread_priority import load_priority
from kvtier.types import BlockHash

log = logging.getLogger(__name__)

STORE = "store"
LOAD = "load"
DISCARD = "discard"  # delete blocks from the medium, in order with the stores
WRITE = "write"  # a store from the medium's own slots (no device block read), apart
_NO_BLOCKS = np.zeros(0, dtype=np.int64)
_STOP = object()
# A merged run takes queued jobs up to about this many bytes. The first job's result
# waits for the whole run (about 50 ms on this machine's 5 GB/s, 12 ms at 20 GB/s),
# while the batch as a whole finishes sooner: a step that needs all its loads gains.
# Measured on bench_store's memory rows: with 64 MiB, shuffled per-layer jobs ran at
# 0.77-0.79 of one big copy; with 256 MiB at 0.80-0.84 (bigger gathers, fewer calls).
MERGE_MAX_BYTES = 256 << 20


class TransferResult(NamedTuple):
    job_id: int
    ok: bool
    bytes: int
    seconds: float


class _Job(NamedTuple):
    job_id: int
    device_ids: npt.NDArray[np.int64]
    spec: LoadStoreSpec | list[BlockHash]  # the hashes, for a discard
    ready: Any


def _left(deadline: float | None) -> float | None:
    """The seconds left until `deadline` (None: no deadline), never below 0."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


class _JobQueue(Protocol):
    """A direction's queue of jobs: `queue.Queue`, or the ordered worker's `_OrderedJobs`."""

    def put_nowait(self, item: Any) -> None: ...
    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None: ...
    def get(self) -> Any: ...
    def get_nowait(self) -> Any: ...


class _OrderedJobs:
    """The ordered worker's one queue (`queue.Queue`'s calls): submission order, except
    that the first load waiting may go ahead of the stores and discards queued before it
    when the handler says it does not depend on them (`load_may_pass`). A request waiting
    on a load then never waits for the disk writes of stores queued before it: the
    cascade's write-through stores, its demotions. Loads keep their order among
    themselves, and the stop marker stays last."""

    def __init__(self, maxsize: int, may_pass: Callable[[Any], bool]) -> None:
        self._items: deque[Any] = deque()
        self._maxsize = maxsize
        self._may_pass = may_pass
        self._ready = threading.Condition()

    def put_nowait(self, item: Any) -> None:
        with self._ready:
            if len(self._items) >= self._maxsize:
                raise queue.Full
            self._items.append(item)
            self._ready.notify()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """The stop marker: never refused."""
        with self._ready:
            self._items.append(item)
            self._ready.notify()

    def get(self) -> Any:
        with self._ready:
            self._ready.wait_for(lambda: bool(self._items))
            return self._take()

    def get_nowait(self) -> Any:
        with self._ready:
            if not self._items:
                raise queue.Empty
            return self._take()

    def _take(self) -> Any:
        items = self._items
        for i, item in enumerate(items):
            if item is _STOP:
                break
            direction, job = item
            if direction == LOAD:
                if i and self._may_pass(job.spec):
                    del items[i]
                    return item
                break
        return items.popleft()


class TransferWorker:
    """Threads and ordering around a `TransferHandler`; see the module docstring."""

    def __init__(
        self,
        handler: TransferHandler,
        *,
        max_queued_jobs: int = 64,
        ordered: bool = False,
        torch_threads: int | None = None,
        name: str = "transfer",
        store_threads: int = 1,
    ) -> None:
        """`ordered=True` runs loads and stores on one thread in submission order (the
        cascade needs it: a demotion must run before any later job reuses its slots).
        `store_threads`: how many threads serve the stores of a worker that is not
        ordered (a slow medium's round trips then overlap; results still come out in
        submission order).
        `torch_threads`: how many threads each worker thread's torch copies may use
        (None: torch's default); see `limit_torch_threads`. `name`: the tier, in its
        threads' names ("kv-<name>-store", "-load", "-jobs" for the ordered thread,
        "-write"; `kvtier.thread_names`)."""
        if max_queued_jobs < 1:
            raise ValueError(f"max_queued_jobs must be >= 1, got {max_queued_jobs}")
        if store_threads < 1 or (
            store_threads > 1 and (ordered or getattr(handler, "discard", None) is not None)
        ):
            raise ValueError(
                f"store_threads={store_threads}; at least 1, and 1 for an ordered worker or "
                "a medium with discards (one thread keeps them in order with the stores)"
            )
        self.max_queued_jobs = max_queued_jobs
        if torch_threads is not None and torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1 or None, got {torch_threads}")
        self._torch_threads = torch_threads
        self.handler = handler
        self._block_bytes = max(1, handler.kv.layout.bytes_per_block)
        # the handler's spec merge (the memory tier has one), looked up once
        self._merge: Callable[[list[LoadStoreSpec]], LoadStoreSpec | None] | None = getattr(
            handler, "merge", None
        )
        self._lock = threading.Condition()
        self._outstanding: set[int] = set()
        self._order: dict[str, deque[int]] = {
            STORE: deque(),
            LOAD: deque(),
            DISCARD: deque(),
            WRITE: deque(),
        }
        self._done: dict[int, TransferResult] = {}
        self._finished: list[TransferResult] = []
        # job id -> time.perf_counter() when its thread took it up, until it finishes
        self._began: dict[int, float] = {}
        self.errors: deque[tuple[int, str]] = deque(maxlen=256)
        # the ordered worker's queue: loads that depend on nothing queued go first
        may_pass: Callable[[Any], bool] | None = getattr(handler, "load_may_pass", None)
        shared: _JobQueue = (
            _OrderedJobs(max_queued_jobs, may_pass)
            if ordered and may_pass is not None
            else queue.Queue(maxsize=max_queued_jobs)
        )
        self._queues: dict[str, _JobQueue] = {
            d: shared if ordered else queue.Queue(maxsize=max_queued_jobs) for d in (STORE, LOAD)
        }
        # each thread's queue and role (in its name; "store" and "write" serve no loads)
        served: list[tuple[_JobQueue, str]] = (
            [(shared, "jobs")]
            if ordered
            else [(self._queues[STORE], "store")] * store_threads + [(self._queues[LOAD], "load")]
        )
        self._queues[DISCARD] = self._queues[STORE]
        if getattr(handler, "write", None) is not None:  # writes from its own slots, apart
            self._queues[WRITE] = queue.Queue(maxsize=max_queued_jobs)
            served.append((self._queues[WRITE], "write"))
        self._threads = [
            threading.Thread(
                target=self._serve,
                args=(q, role in ("store", "write"), f"kv-{name}-{role}"),
                name=f"kvtier-{name}-{role}",
                daemon=True,
            )
            for q, role in served
        ]
        self._closed = False
        # a queue per thread still to get its stop marker, and the handler's close
        self._unstopped: list[_JobQueue] = [q for q, _ in served]
        self._close_handler: Callable[[], None] | None = getattr(handler, "close", None)
        for thread in self._threads:
            thread.start()

    @classmethod
    def for_store(
        cls,
        kv: DeviceKV,
        store: BlockStore | MemoryStore,
        *,
        max_queued_jobs: int = 64,
        torch_threads: int | None = None,
        copy_threads: int = 1,
        name: str = "transfer",
        store_threads: int = 1,
    ) -> TransferWorker:
        """A worker moving `kv`'s blocks to and from `store` (direct copies for memory;
        `copy_threads`: see `HostSlotHandler`; `name`: see `__init__`)."""
        handler: TransferHandler
        if isinstance(store, MemoryStore):
            handler = HostSlotHandler(kv, store, copy_threads=copy_threads)
        else:
            handler = StagedHandler(kv, store)
        return cls(
            handler,
            max_queued_jobs=max_queued_jobs,
            torch_threads=torch_threads,
            name=name,
            store_threads=store_threads,
        )

    # submission (scheduler thread)

    def submit_store(
        self,
        job_id: int,
        device_block_ids: Sequence[int] | npt.NDArray[np.int64],
        dst_spec: LoadStoreSpec,
    ) -> bool:
        """Queue a store; False when rejected (reported later as a failed result)."""
        ids = self.handler.kv.block_ids(device_block_ids)
        job = _Job(job_id, ids, dst_spec, self.handler.ready_event())
        return self._submit(STORE, job)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        device_block_ids: Sequence[int] | npt.NDArray[np.int64],
    ) -> bool:
        """Queue a load; False when rejected (reported later as a failed result)."""
        ids = self.handler.kv.block_ids(device_block_ids)
        return self._submit(LOAD, _Job(job_id, ids, src_spec, self.handler.ready_event()))

    def submit_discard(self, job_id: int, block_hashes: Sequence[BlockHash]) -> bool:
        """Queue the deletion of blocks the scheduler let go of (evicted, or failed). It
        runs in order with the stores, so a store submitted after it that reuses their
        room finds them gone; its result comes like any job's."""
        if getattr(self.handler, "discard", None) is None:
            raise TypeError(f"{type(self.handler).__name__} holds no blocks to discard")
        return self._submit(DISCARD, _Job(job_id, _NO_BLOCKS, list(block_hashes), None))

    def submit_write(self, job_id: int, spec: LoadStoreSpec) -> bool:
        """Queue a store that reads no device block (`handler.write(spec)`); see the
        module docstring."""
        if WRITE not in self._queues:
            raise TypeError(f"{type(self.handler).__name__} has no writes from its own slots")
        return self._submit(WRITE, _Job(job_id, _NO_BLOCKS, spec, None))

    def _submit(self, direction: str, job: _Job) -> bool:
        with self._lock:
            if self._closed:
                raise RuntimeError("submit on a closed TransferWorker")
            if job.job_id in self._outstanding:
                raise ValueError(f"job id {job.job_id} is already in flight")
            self._outstanding.add(job.job_id)
            self._order[direction].append(job.job_id)
            # Queued under the lock, so close() cannot put its stop marker ahead of a
            # job it let through (that job would never run and wait() would hang).
            # The Condition's lock is re-entrant, so _complete may take it again.
            try:
                self._queues[direction].put_nowait((direction, job))
            except queue.Full:
                self.errors.append((job.job_id, f"{direction} queue full"))
                self._complete(direction, TransferResult(job.job_id, False, 0, 0.0))
                return False
        return True

    # completion

    def get_finished(self) -> list[TransferResult]:
        """Results released since the last call, in submission order per direction."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    @property
    def num_in_flight(self) -> int:
        """Jobs submitted and not yet handed out by `get_finished` (what the worker holds)."""
        with self._lock:
            return len(self._outstanding) + len(self._finished)

    def writes_room(self) -> int:
        """How many more writes (`submit_write`) the writer's queue takes now; one past it
        is refused (a failed result)."""
        with self._lock:
            return self.max_queued_jobs - len(self._order[WRITE])

    def began(self, job_id: int) -> float | None:
        """When (`time.perf_counter()`) a thread took the job up; None while it is still
        queued (behind a job of its own direction, or a store in the ordered worker) and
        once it has finished. What a load waited in the queue is not its medium's time."""
        return self._began.get(job_id)

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until every listed job has finished; False on timeout."""
        wanted = set(job_ids)
        with self._lock:
            return self._lock.wait_for(lambda: not (wanted & self._outstanding), timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued jobs, then stop the threads; whether they have stopped. False if
        `timeout` seconds passed first (a medium that hangs): the threads are left to end
        on their own (daemons: they never keep the process from exiting), and the
        handler with them; a later call asks again."""
        with self._lock:
            self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._unstopped:  # a stop marker for each thread, once
            try:
                self._unstopped[0].put(_STOP, timeout=_left(deadline))
            except queue.Full:  # its thread hangs on a job, with a full queue behind it
                log.warning("transfer worker: closing with a full queue; its thread hangs")
                return False
            self._unstopped.pop(0)
        for thread in self._threads:
            thread.join(_left(deadline))
            if thread.is_alive():
                log.warning("transfer worker: %s still busy at close; left running", thread.name)
                return False
        close, self._close_handler = self._close_handler, None
        if close is not None:  # a handler's own helper threads
            close()
        return True

    def __enter__(self) -> TransferWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # worker threads

    def _serve(self, jobs: _JobQueue, stores_only: bool = False, name: str = "") -> None:
        """`stores_only`: this thread serves no loads, which a request waits for, so it
        copies on the cores vLLM keeps for the connector (`leave_compute_cores`);
        `name`: its name in the kernel's lists."""
        if name:
            name_native_thread(name)
        if self._torch_threads is not None:
            limit_torch_threads(self._torch_threads)
        if stores_only:
            leave_compute_cores()
        item = jobs.get()
        while item is not _STOP:
            direction, job = item
            batch, item = self._take_queued(jobs, direction, job)
            began = time.perf_counter()
            for taken in batch:
                self._began[taken.job_id] = began
            try:
                results = self._run_batch(direction, batch)
            except Exception as exc:  # a bug here must fail the jobs, not stop the thread
                log.exception("transfer worker: %s batch failed", direction)
                self.errors.extend((j.job_id, repr(exc)) for j in batch)
                results = [TransferResult(j.job_id, False, 0, 0.0) for j in batch]
            for result in results:
                self._complete(direction, result)
            if item is None:
                item = jobs.get()

    def _take_queued(self, jobs: _JobQueue, direction: str, job: _Job) -> tuple[list[_Job], Any]:
        """`job` and the jobs of the same direction queued right behind it (when the
        handler merges), and the next item to serve (None: take one from the queue)."""
        batch = [job]
        if self._merge is None or direction in (DISCARD, WRITE):
            return batch, None
        blocks, limit = len(job.device_ids), MERGE_MAX_BYTES // self._block_bytes
        while blocks < limit:
            try:
                item = jobs.get_nowait()
            except queue.Empty:
                return batch, None
            if item is _STOP or item[0] != direction:  # kept, in order, for after the batch
                return batch, item
            batch.append(item[1])
            blocks += len(item[1].device_ids)
        return batch, None

    def _run_batch(self, direction: str, batch: list[_Job]) -> list[TransferResult]:
        """Run queued jobs as one when their specs merge; their results, in order. Loads
        run at a raised priority where the process may (`thread_priority`)."""
        if direction == LOAD:
            with load_priority():
                return self._run_merged(direction, batch)
        return self._run_merged(direction, batch)

    def _run_merged(self, direction: str, batch: list[_Job]) -> list[TransferResult]:
        merged = self._merged(direction, batch) if len(batch) > 1 else None
        if merged is None:
            return [self._run(direction, job) for job in batch]
        result = self._run(direction, merged, merged=len(batch))
        if not result.ok:  # find the failing jobs: each runs alone, as if never merged
            return [self._run(direction, job) for job in batch]
        # each job's share of the bytes and the time, by its blocks (evenly if none has any)
        blocks = [len(job.device_ids) for job in batch]
        total = sum(blocks)
        shares = [n / total for n in blocks] if total else [1 / len(batch)] * len(batch)
        return [
            TransferResult(
                job.job_id, True, result.bytes * n // max(total, 1), result.seconds * share
            )
            for job, n, share in zip(batch, blocks, shares, strict=True)
        ]

    def _merged(self, direction: str, batch: list[_Job]) -> _Job | None:
        """One job for all of `batch`, or None when it cannot be one: the handler cannot
        merge the specs (it also refuses repeated medium slots), or a load would write a
        device block twice (then the order of the writes would matter)."""
        if self._merge is None:
            return None
        try:
            spec = self._merge([cast(LoadStoreSpec, job.spec) for job in batch])
        except Exception:  # a bad spec fails its own job when the jobs run one by one
            return None
        if spec is None:
            return None
        ids = np.concatenate([job.device_ids for job in batch])
        if direction == LOAD and len(np.unique(ids)) != len(ids):
            return None
        # the copy waits for the last job's compute event: events are recorded in
        # submission order on one stream, so it follows all the earlier ones too
        return _Job(batch[0].job_id, ids, spec, batch[-1].ready)

    def _run(self, direction: str, job: _Job, *, merged: int = 0) -> TransferResult:
        """Run one job; a failure is logged and recorded against it, unless the job is a
        merge of `merged` queued jobs (they are then run one by one, and those fail)."""
        start = time.perf_counter()
        try:
            if isinstance(job.spec, list):  # a discard
                self.handler.discard(job.spec)  # type: ignore[attr-defined]
                moved = 0
            elif direction == WRITE:
                moved = self.handler.write(job.spec)  # type: ignore[attr-defined]
            elif direction == STORE:
                moved = self.handler.store(job.device_ids, job.spec, job.ready)
            else:
                moved = self.handler.load(job.spec, job.device_ids, job.ready)
        except Exception as exc:  # a medium failure fails this job, never the scheduler
            if merged:
                log.debug("%s of %d merged jobs failed (%r): one by one", direction, merged, exc)
            else:
                log.warning("%s job %s failed: %r", direction, job.job_id, exc)
                self.errors.append((job.job_id, repr(exc)))
            return TransferResult(job.job_id, False, 0, time.perf_counter() - start)
        return TransferResult(job.job_id, True, moved, time.perf_counter() - start)

    def _complete(self, direction: str, result: TransferResult) -> None:
        with self._lock:
            self._began.pop(result.job_id, None)
            self._done[result.job_id] = result
            order = self._order[direction]
            while order and order[0] in self._done:
                released = self._done.pop(order.popleft())
                self._outstanding.discard(released.job_id)
                self._finished.append(released)
            self._lock.notify_all()
