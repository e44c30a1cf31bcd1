"""Per-key lookups answered off the scheduler thread, for vLLM's tiering layer.

vLLM's tiering scheduler asks a secondary tier about one key at a time and keeps
going past RETRY, so in one step it asks about every key of a prompt. Here the keys
one request asked about in a step go out at the step's end (`flush`) as one batch,
answered by one `count_prefix` round trip on a background thread; until the answer is
in, `lookup` says None (RETRY). A key's verdict is kept while a request that asked
for it is alive (the scheduler asks again on later steps), and a failed load marks
it a miss, so a promotion that cannot succeed is not retried forever. A round trip
that got no answer (a timeout on a busy machine) is no verdict: its keys are asked
again at the next flush, and are a miss only once `tier_down` says the tier is down
(a miss at once would cut a prefix short at the key whose round trip timed out).

vLLM ships `AsyncLookupManager` for the same job; this small one exists because
`drain_jobs`, `shutdown` and deterministic tests need to wait for answers, which
vLLM's offers no way to do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# how many leading keys the tier holds, or None when it gave no answer
CountPrefix = Callable[[Sequence[bytes]], int | None]


@dataclass
class _Ask:
    requests: set[str] = field(default_factory=set)
    future: Future[int | None] | None = None  # None until flushed
    index: int = 0  # the key's place in its batch: present iff index < the prefix count
    verdict: bool | None = None


class KeyLookups:
    def __init__(
        self, count_prefix: CountPrefix, name: str, tier_down: Callable[[], bool] = lambda: False
    ) -> None:
        self._count = count_prefix
        self._tier_down = tier_down
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{name}-lookup")
        self._asks: dict[bytes, _Ask] = {}
        self._request_keys: dict[str, set[bytes]] = {}
        self._batch: dict[str, list[bytes]] = {}  # asked this step, not yet sent

    def lookup(self, key: bytes, req_id: str) -> bool | None:
        """True (present), False (absent) or None (not known yet: ask on a later step)."""
        ask = self._asks.get(key)
        if ask is None:
            ask = self._asks[key] = _Ask()
            self._batch.setdefault(req_id, []).append(key)
        ask.requests.add(req_id)
        self._request_keys.setdefault(req_id, set()).add(key)
        if ask.verdict is None and ask.future is not None and ask.future.done():
            found = self._result(ask.future)
            if found is not None:
                ask.verdict = ask.index < found
            elif self._tier_down():
                ask.verdict = False
            else:  # no answer: asked again at the next flush
                ask.future = None
                self._batch.setdefault(req_id, []).append(key)
        return ask.verdict

    def flush(self) -> None:
        """Send the keys asked this step: one background round trip per request."""
        batch, self._batch = self._batch, {}
        for keys in batch.values():
            asks = [(i, self._asks.get(key)) for i, key in enumerate(keys)]
            live = [(i, ask) for i, ask in asks if ask is not None and ask.future is None]
            if not live:
                continue  # every request that asked has finished
            future = self._executor.submit(self._count, keys)
            for i, ask in live:
                ask.future, ask.index = future, i

    def mark_miss(self, keys: Collection[bytes]) -> None:
        for key in keys:
            ask = self._asks.get(key)
            if ask is not None:
                ask.verdict = False

    def cleanup(self, req_id: str) -> None:
        """Forget what only this (finished) request asked about."""
        for key in self._request_keys.pop(req_id, ()):
            ask = self._asks.get(key)
            if ask is not None:
                ask.requests.discard(req_id)
                if not ask.requests:
                    del self._asks[key]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every flushed lookup is answered; False on timeout."""
        futures = {id(a.future): a.future for a in self._asks.values() if a.future is not None}
        return not wait(list(futures.values()), timeout=timeout).not_done

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._asks.clear()
        self._batch.clear()

    @staticmethod
    def _result(future: Future[int | None]) -> int | None:
        try:
            return future.result()
        except Exception:  # count_prefix turns server failures into None; this is a bug
            log.exception("kvtier: background lookup failed; answering a miss")
            return 0
