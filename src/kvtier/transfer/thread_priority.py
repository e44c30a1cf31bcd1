"""A load runs at a raised scheduling priority, where the process may raise it.

A load is what a request waits for. On a CPU engine whose workers compute on every core
(tensor-parallel size equal to the core count: `VLLM_CPU_OMP_THREADS_BIND="0|1"` on
two), no core is left for kvtier's threads (`device.leave_compute_cores`), and between
steps vLLM's processes do not sleep: the readers of its shared-memory message queues
spin (`sched_yield`) for a second after each message, and an engine whose requests wait
on a load runs empty steps. The kernel let those spinners starve the thread that reads a
load from Redis for seconds. Measured on this 2-core machine (a two-worker engine
loading returning 4,096-token prompts from Redis, eight loads a run): in five runs, 16
of 40 requests took 1.1 to 21 s to their first token against 0.22 to 0.88 s for the
rest, and 5 of those failed at the 5 s socket timeout and were recomputed; over a stall
the engine's three main threads took 96% of both cores and the loading thread and the
Redis server next to none. With the loading thread at nice -10, 3 of 40 in three runs still
failed (README, `bench_vllm --shapes cross`): the stalls remain, and whether they are
rarer is within the noise of so few runs. A real-time sampler waking every 50 ms on the
same machine made them vanish in a run: the spinners were not preempted for a waking
thread. What stopped them was taking a spinner away: the worker that finished its part
of a load first now idles through the engine's empty steps instead of spinning
(`KvtierConnector.get_finished`; 24 of 24 loads whole in three such runs). The raised
priority stays, for a load that must share its core with compute all the same.

The priority is raised for the load only (a thread that also serves stores, the
cascade's ordered worker, copies those at its usual priority: a store competes with the
model's compute, a load is waited for) and only by the thread itself (`setpriority` on
its own thread id, Linux). Without the right to raise it (CAP_SYS_NICE or RLIMIT_NICE),
nothing changes: the first refusal is logged once, and later loads do not ask again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

# the nice value a load runs at (-20 highest, 0 default): high enough that a waking
# loader is run before the spinners, as nice -10 was in the measurement above
LOAD_NICE = -10

_denied = threading.Event()  # the process may not raise a thread's priority: stop asking


@contextlib.contextmanager
def load_priority(nice: int = LOAD_NICE) -> Iterator[bool]:
    """Run the body at `nice` (if that is higher than the thread's own priority);
    yields whether it did. The thread's priority is put back after."""
    if not -20 <= nice <= 19:
        raise ValueError(f"nice={nice}; a nice value is between -20 and 19")
    raised, before, tid = False, 0, 0
    if sys.platform.startswith("linux") and not _denied.is_set():
        tid = threading.get_native_id()
        try:
            before = os.getpriority(os.PRIO_PROCESS, tid)
            if nice < before:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                raised = True
        except PermissionError as exc:
            _denied.set()
            log.info(
                "kvtier: loads run at the threads' own priority (raising it to nice %d "
                "was refused: %s); see the README's tensor parallelism notes",
                nice,
                exc,
            )
        except OSError as exc:  # a thread id the kernel does not know: leave it
            log.debug("kvtier: load priority unchanged: %s", exc)
    try:
        yield raised
    finally:
        if raised:
            with contextlib.suppress(OSError):  # lowering one's own priority is always allowed
                os.setpriority(os.PRIO_PROCESS, tid, before)


__all__ = ["LOAD_NICE", "load_priority"]
