"""When a request's moments happen: all at once, or at virtual times.

`at_once`: each request is admitted, loaded, computed and finished before the
next arrives (the cache as a tool sees it, and the golden figures).

`VirtualClock`: requests overlap by arrival time (the trace's timestamps, in ms:
runs are reproducible and fast). A request's load stays in flight for the length
of its prefill (`TimeModel`), so other requests arriving meanwhile cannot read
those blocks yet (lookups stop there) nor evict them (pinned); its computed
blocks are stored when its prefill ends; with an accelerator tier it holds its
blocks until its decode ends, and requests that find no room wait in arrival
order (head of line). One that cannot fit even an idle pool is dropped and
counted as unschedulable.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass

from kvtier.sim.replay_config import PROGRESS_EVERY, Progress, TimeModel
from kvtier.sim.step import Pending, Step
from kvtier.sim.workload import Workload


@dataclass
class Waits:
    """Requests the accelerator could not take: never (too large) or not at once."""

    unschedulable: int = 0
    waited: int = 0


def at_once(step: Step, progress: Progress | None = None) -> Waits:
    waits = Waits()
    for k, i in enumerate(step.indexes()):
        if progress is not None and k % PROGRESS_EVERY == 0:
            progress(i)
        p = step.admit(i)
        if p is None:
            waits.unschedulable += 1  # larger than the whole accelerator pool
            continue
        step.loaded(p)
        step.computed(p)
        step.finished(p)
    return waits


_PREFILL, _DECODE = 0, 1


class VirtualClock:
    def __init__(self, workload: Workload, step: Step, model: TimeModel) -> None:
        self.w, self.step, self.model = workload, step, model
        self.events: list[tuple[float, int, int, Pending]] = []
        self.waiting: deque[int] = deque()
        self.seq = itertools.count()
        self.running = 0
        self.waits = Waits()
        self.now = 0.0  # the virtual time of the moment being run (ms)

    def run(self, progress: Progress | None = None) -> Waits:
        for k, i in enumerate(self.step.indexes()):
            if progress is not None and k % PROGRESS_EVERY == 0:
                progress(i)
            now = self.w.requests[i].timestamp
            self.advance(now)
            self.waiting.append(i)
            self.drain(now)
            if self.waiting and self.waiting[-1] == i:
                self.waits.waited += 1
        self.advance(float("inf"))
        return self.waits

    def advance(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            now, _, kind, p = heapq.heappop(self.events)
            self.now = now
            if kind == _PREFILL:  # the load is done, the computed blocks are stored
                self.step.loaded(p)
                self.step.computed(p)
                output = self.w.requests[p.index].output_length
                self._at(now + self.model.decode_ms(output), _DECODE, p)
            else:
                self.step.finished(p)
                self.running -= 1
                self.drain(now)

    def _at(self, when: float, kind: int, p: Pending) -> None:
        if kind == _DECODE and not self.step.holds_blocks:  # nothing to free
            self.running -= 1
            return
        heapq.heappush(self.events, (when, next(self.seq), kind, p))

    def drain(self, now: float) -> None:
        self.now = now
        while self.waiting:
            p = self.step.admit(self.waiting[0])
            if p is not None:
                self.waiting.popleft()
                self.running += 1
                prefill = self.model.prefill_ms(p.uncached_tokens, p.loaded_blocks)
                self._at(now + prefill, _PREFILL, p)
            elif self.running == 0:
                self.waiting.popleft()
                self.waits.unschedulable += 1
            else:
                break
