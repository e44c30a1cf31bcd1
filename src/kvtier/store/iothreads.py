"""Spread one job's blocks over a few threads, each taking the next block not yet taken.

Why threads help a file-per-block tier even under the GIL: `open`, `readv`, `write`,
`fsync` and python-xxhash's hashing all release it, and the Python left between them
is a small part of a block's time. One thread keeps a single request in flight and
hashes on one core; two keep the device's queue (and both cores) busy.

Why each thread takes the next block rather than a fixed half of the job: on a shared
machine one thread is now and then held up for milliseconds, and with fixed halves the
job then waits for that thread's half; this way the other thread takes over the rest.
The blocks are handed out by a shared `itertools.count`, whose `next()` is atomic
under the GIL: no lock and no queue per block.

The calling thread takes part itself, so a job never waits for a pool thread to be
free just to start, and pool tasks never wait on the pool (no deadlock when a
worker's store and load threads share it).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.thread_names import named


class IOThreads:
    """The calling thread plus `threads - 1` helper threads, shared by all jobs."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {threads}")
        self.threads = threads
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def for_each(self, count: int, work: Callable[[int], None], *, alone: bool = False) -> None:
        """Call `work(i)` once for each `i` in `range(count)`, on up to `threads` threads
        (only the calling one if `alone`: for jobs too small to repay waking a helper),
        and return once all calls have. After a call raises, blocks not yet taken are
        skipped; the exception (the caller thread's, else the first helper's) is raised
        once every thread has stopped."""
        helpers = 0 if alone else min(self.threads, count) - 1
        if helpers <= 0:
            for index in range(count):
                work(index)
            return
        claims = itertools.count()  # next() is atomic under the GIL
        failed = threading.Event()

        def drain() -> None:
            try:
                while (index := next(claims)) < count and not failed.is_set():
                    work(index)
            except BaseException:
                failed.set()
                raise

        pool = self._executor()
        futures: list[Future[None]] = [pool.submit(drain) for _ in range(helpers)]
        error: BaseException | None = None
        try:
            drain()
        except BaseException as exc:  # re-raised below, once the helpers have stopped
            error = exc
        for future in futures:
            if future.cancel():
                continue  # never started (the pool busy with another job): nothing to wait for
            failure = future.exception()  # waits for the helper
            if error is None and failure is not None:
                error = failure
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the helper threads (they restart on demand, and also stop when this
        object is collected)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.threads - 1,
                    thread_name_prefix=self._name,
                    initializer=named(self._name.replace("kvtier-", "kv-", 1)),
                )
            return self._pool
