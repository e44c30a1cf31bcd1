"""kvtier's threads under names of their own in the kernel's lists (`top -H`, `ps -L`,
`/proc/<pid>/task/*/comm`, perf), not their process's.

Python names a thread for Python only: every thread of a vLLM worker shows as
`VLLM::Worker_TP0`, so what a side's extra CPU went to (the model's compute, or
kvtier's copies, sends and lookups) could not be told apart in a benchmark
(`bench_serving`'s `server_cpu_by_thread`) or by an operator looking at `top -H`.
Linux keeps the first 15 bytes of a thread's name.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

MAX_NAME_BYTES = 15  # the kernel's TASK_COMM_LEN less its terminating zero


def name_native_thread(name: str) -> bool:
    """Give the calling thread `name` (its first 15 bytes) in the kernel's lists;
    whether it did (Linux only; a failure changes nothing)."""
    if not name:
        raise ValueError("a thread name must not be empty")
    if not sys.platform.startswith("linux"):
        return False
    short = name.encode()[:MAX_NAME_BYTES]
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "wb") as comm:
            comm.write(short)
    except OSError:
        return False
    return True


def named(name: str) -> Callable[[], bool]:
    """An executor's `initializer` that names each of its threads `name`."""
    return lambda: name_native_thread(name)


__all__ = ["MAX_NAME_BYTES", "name_native_thread", "named"]
