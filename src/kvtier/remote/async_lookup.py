"""Lookups answered off the scheduler thread: vLLM's "None means ask again".

A synchronous lookup costs the scheduler one Redis round trip per request per
step. With this, the first `lookup` of a prefix submits it to a background
thread and answers None; the scheduler asks again on a later step and gets the
count once it is there (and a repeated question after that starts a fresh one).
Unanswered questions are bounded: the oldest is forgotten first (and not sent,
if it has not started: the executor's queue is bounded by the same number). The
questions queued while the thread waits on a round trip go out together in the
next one (`try_count_prefixes`): vLLM asks block by block, a prompt's blocks in
one step, and one round trip per block made a 4,096-token prompt wait on 128 of
them in turn, each one slow on a busy machine.

A round trip that failed (a timeout: on a loaded machine the server or this
thread may get no CPU for the whole socket timeout) is no answer: the question is
sent again, and answered as a miss only once the circuit breaker says the tier is
down. Answered as a miss at once, it cut a prefix short at the block whose lookup
timed out: vLLM asks block by block, and loads the hits before the first miss.

vLLM walks a prompt's keys one by one in one call, and the first question sent would
go out alone, the rest of the prompt a round trip later (two round trips before a
slow Redis's hit is known: 0.4 s through a link adding 0.2 s). Inside `held()` (the
connector holds them for one request's walk) questions are only queued, and go out
together when it ends, or when someone waits for an answer (`wait`).

Where a round trip costs more than carrying a block (a slow link), the thread reads the
first blocks of a round trip whole (`fetch_blocks`, set by the connector from its cost
estimates; `prefetch`), so that a load that follows in this process costs no second one.
A round trip that carried blocks is no sample of the round trip: its time less an
estimate of the carrying fed that estimate back into itself (an inflated block time made
the round trip look shorter, which made the next load's blocks look slower), so the
round trip is timed on the lookups that carried nothing (every miss).

An answer nobody collected (the request went away first) is not handed out later: one
older than `max_age_s` is asked again, since the blocks may have been stored or evicted
since (a stale hit costs a failed load, a stale miss a recompute). A block this engine
stored itself makes every answer already in that asked about it stale (`stored`): a
turn of a conversation that missed went on without its answer, and when the next turn
came back within `max_age_s` (one at a time, six conversations of 0.3 s each) it was
handed that miss for the history this engine had stored since, and recomputed it. A
stale answer is still what the tier said when asked (`peek` gives it: the hit share of
the requests that went on without their answers counts it), but never an answer to a
question asked again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager

from kvtier.remote.redis_store import RedisBlockStore
from kvtier.thread_names import named
from kvtier.types import BlockHash

log = logging.getLogger(__name__)


# a question's answer: the count (None: the server gave none) and when it came
_Answer = tuple[int | None, float]


class AsyncLookups:
    def __init__(
        self,
        store: RedisBlockStore,
        salt: str | None,
        max_pending: int = 4096,
        max_age_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0 seconds, got {max_age_s!r}")
        self.store = store
        self.salt = salt
        self.max_pending = max_pending
        self.max_age_s = max_age_s
        self._clock = clock
        self._pending: OrderedDict[tuple[BlockHash, ...], Future[_Answer]] = OrderedDict()
        # the pending questions of more than one block (`stored` finds them without
        # reading every question: vLLM's are of one block each)
        self._multi: set[tuple[BlockHash, ...]] = set()
        # answered questions about blocks stored since (`stored`): asked again, not handed out
        self._stale: set[tuple[BlockHash, ...]] = set()
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-remote-lookup", initializer=named("kv-redis-lookup")
        )
        self._seconds: deque[float] = deque(maxlen=max_pending)  # appended off-thread
        # questions not sent yet: (block hashes, salt, future); taken by the thread
        self._queued: deque[tuple[list[BlockHash], str | None, Future[_Answer]]] = deque()
        self._lock = threading.Lock()
        self._held = 0  # depth of `held()`: while > 0, questions wait to be sent together
        self._unsent = False  # a question was queued and no send submitted for it yet
        # how many blocks a round trip reads whole (see the module docstring); none
        # without it
        self.fetch_blocks: Callable[[], int] | None = None
        self._trips = 0  # round trips started, which numbers them
        # the round trip on its way (its number, and when it started); None between them
        self._in_flight: tuple[int, float] | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        """Questions asked inside go out together, in one round trip, when it ends."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                self._send()

    def _send(self) -> None:
        """Have the thread send what is queued (it finds it sent already, or sends it)."""
        if self._unsent:
            self._unsent = False
            self._executor.submit(self._send_queued)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int | None:
        key = tuple(block_hashes)
        future = self._pending.get(key)
        if future is None:
            if len(self._pending) >= self.max_pending:
                oldest, forgotten = self._pending.popitem(last=False)
                self._multi.discard(oldest)
                self._stale.discard(oldest)
                forgotten.cancel()  # no answer will be asked for: don't queue its round trip
            future = self._pending[key] = Future()
            if len(key) > 1:
                self._multi.add(key)
            with self._lock:
                self._queued.append((list(block_hashes), self.salt, future))
            self._unsent = True
            if not self._held:
                self._send()
            return None
        if not future.done():
            return None
        del self._pending[key]
        self._multi.discard(key)
        stale = key in self._stale
        self._stale.discard(key)
        try:
            found, answered_at = future.result()
        except Exception:  # the store never raises; a bug must not reach the scheduler
            log.exception("remote tier: background lookup failed; answering a miss")
            return 0
        if stale or self._clock() - answered_at > self.max_age_s:
            return self.lookup(block_hashes)  # left uncollected: asked again
        if found is None:  # the server gave no answer
            if self.store.breaker.rejecting():
                return 0  # the tier is down: a miss, until the breaker lets calls through
            return self.lookup(block_hashes)  # not known: asked again
        return found

    def stored(self, block_hashes: Sequence[BlockHash]) -> None:
        """These blocks were stored in the tier since: answers already in that asked
        about any of them are stale (asked again if wanted, still there to `peek`; see
        the module docstring). A question still in flight keeps its round trip, which
        may have seen the store."""
        if not self._pending:
            return
        hashes = set(block_hashes)
        keys = [(h,) for h in hashes] + [k for k in self._multi if not hashes.isdisjoint(k)]
        for key in keys:
            future = self._pending.get(key)
            if future is not None and future.done():
                self._stale.add(key)

    def peek(self, block_hashes: Sequence[BlockHash]) -> int | None:
        """The answer to a question asked earlier, if it is in, without taking it (it
        stays for whoever asks) and without asking anything: None if not asked, not
        answered yet, or answered with no count."""
        future = self._pending.get(tuple(block_hashes))
        if future is None or not future.done() or future.cancelled():
            return None
        if future.exception() is not None:
            return None
        return future.result()[0]

    def _send_queued(self) -> None:
        """Every question queued so far (not forgotten), in one round trip per salt."""
        with self._lock:
            queued, self._queued = self._queued, deque()
        batches: dict[str | None, list[tuple[list[BlockHash], Future[_Answer]]]] = {}
        for hashes, salt, future in queued:
            if future.set_running_or_notify_cancel():  # False: forgotten, never sent
                batches.setdefault(salt, []).append((hashes, future))
        for salt, batch in batches.items():
            fetch = self.fetch_blocks() if self.fetch_blocks is not None else 0
            started = time.perf_counter()
            trips_before = getattr(self.store, "lookup_round_trips", 0)
            fetched_before = getattr(self.store, "fetched_blocks", 0)
            self._trips += 1
            self._in_flight = (self._trips, self._clock())
            try:
                found = self.store.try_count_prefixes([h for h, _ in batch], salt, fetch)
            except Exception as exc:  # a bug: each question's answer raises it
                for _, future in batch:
                    future.set_exception(exc)
                continue
            finally:
                self._in_flight = None
            # one round trip's seconds (a lookup of blocks another layout wrote takes
            # more than one; the estimate is of the one a load pays), unless it carried
            seconds = time.perf_counter() - started
            if getattr(self.store, "fetched_blocks", 0) == fetched_before:
                trips = getattr(self.store, "lookup_round_trips", 0) - trips_before
                self._seconds.append(seconds / max(trips, 1))
            answers: list[int | None] = [None] * len(batch) if found is None else [*found]
            answered_at = self._clock()
            for (_, future), answer in zip(batch, answers, strict=True):
                future.set_result((answer, answered_at))

    def in_flight(self) -> tuple[int, float] | None:
        """The round trip on its way now: its number (round trips are numbered as they
        start) and the seconds since it started; None between round trips. Questions
        asked meanwhile wait for it to end (one thread sends them in turn), and its
        age is what the tier's round trips take now, at least: a tier that stalled is
        known slow before its first slow answer is in (`CostModel.lookup_too_slow`)."""
        trip = self._in_flight  # one read: the thread replaces it whole
        if trip is None:
            return None
        number, since = trip
        return number, max(self._clock() - since, 0.0)

    def take_seconds(self) -> list[float]:
        """Each round trip's seconds since the last call (at most the last `max_pending`)."""
        taken = []
        while self._seconds:
            taken.append(self._seconds.popleft())
        return taken

    def reset(self, salt: str | None) -> None:
        """Ask under `salt` from now on; questions asked before are forgotten unanswered."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._multi.clear()
        self._stale.clear()
        self.salt = salt

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every lookup asked has an answer (questions held are sent now)."""
        self._send()
        return not wait(list(self._pending.values()), timeout=timeout).not_done

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for future in self._pending.values():
            future.cancel()  # those never sent: nobody waits on them forever
        self._pending.clear()
        self._multi.clear()
        self._stale.clear()
