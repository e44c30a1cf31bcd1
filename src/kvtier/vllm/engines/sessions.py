"""What a server's processes take from the machine, read from Linux's /proc: the CPU
seconds of a session (a server and every process it started), and the cores its vLLM
workers compute on. For benchmarks, which run both sides and their stand-ins for other
machines (a Redis, a link) on the same few cores."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

WORKER_TITLE = "VLLM::Worker"  # the process title vLLM's CPU workers take


def _stats(pattern: str) -> Iterator[tuple[int, str, list[str]]]:
    """(id, command name, the stat fields after the name) of each live process or thread
    whose stat file matches `pattern` (one that ends meanwhile is left out)."""
    for stat in Path("/proc").glob(pattern):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        yield int(stat.parent.name), name, text[text.rindex(")") + 2 :].split()


def _processes() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, command name, the stat fields after the name) of each live process."""
    return _stats("[0-9]*/stat")


def session_cpu_seconds(session: int) -> float:
    """The user and system CPU seconds of the live processes of a session (a process
    that exits in the meantime is left out)."""
    ticks = sum(
        int(fields[11]) + int(fields[12])  # utime, stime
        for _, _, fields in _processes()
        if int(fields[3]) == session  # the session id
    )
    return ticks / os.sysconf("SC_CLK_TCK")


def session_thread_cpu_seconds(session: int) -> dict[str, float]:
    """The CPU seconds of a session's live threads, summed by process title and thread
    name ("VLLM::Worker/kv-redis-store"; a name's trailing number dropped, so a pool's
    threads add up): which of a server's threads took a side's extra CPU."""
    ticks: dict[str, int] = {}
    for pid, name, fields in _processes():
        if int(fields[3]) != session:
            continue
        for _, thread, times in _stats(f"{pid}/task/*/stat"):
            key = f"{name}/{thread.rstrip('0123456789_-') or '?'}"
            ticks[key] = ticks.get(key, 0) + int(times[11]) + int(times[12])
    per_tick = 1 / os.sysconf("SC_CLK_TCK")
    return {key: n * per_tick for key, n in ticks.items()}


def compute_cores(sessions: Iterable[int]) -> set[int]:
    """The cores the vLLM CPU workers of these sessions are bound to (their main
    threads, where the model computes); empty where none is bound to fewer than all."""
    wanted = set(sessions)
    everything = set(range(os.cpu_count() or 1))
    cores: set[int] = set()
    for pid, name, fields in _processes():
        if int(fields[3]) in wanted and name.startswith(WORKER_TITLE):
            try:
                allowed = os.sched_getaffinity(pid)
            except OSError:
                continue
            if allowed != everything:
                cores |= allowed
    return cores


def move_processes(pids: Iterable[int], cores: set[int]) -> None:
    """Every thread of these processes onto `cores` (threads they start later inherit
    their starter's cores)."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), cores)
