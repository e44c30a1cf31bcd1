"""Peak memory of each side's processes, for bench_peers' memory row.

A side is one or more process sessions (vLLM's server and the engine core it spawns;
LMCache's server too). Summing each process's peak resident set (VmHWM) counts the
pages processes share (torch's libraries, a shared-memory buffer both map) once per
process, so the row's figure is the peak over samples of the side's summed PSS
(proportional set size: a shared page split between its users), read from
/proc/PID/smaps_rollup; the summed VmHWM is kept beside it as an upper bound.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

PROC = Path("/proc")


def session_pids(sessions: Iterable[int], proc: Path = PROC) -> list[int]:
    """Every live process whose session id is one of `sessions`."""
    wanted = set(sessions)
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited meanwhile
            continue
        # the command name, in parentheses, may hold spaces: fields count from its end
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) in wanted:  # state, ppid, pgrp, session
            pids.append(int(entry.name))
    return sorted(pids)


def _kib(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def process_name(pid: int, proc: Path = PROC) -> str:
    """The process's command name (vLLM names its engine core and workers: `VLLM::...`)."""
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def pss_kib(pid: int, proc: Path = PROC) -> int:
    return _kib(proc / str(pid) / "smaps_rollup", "Pss")


def hwm_kib(pid: int, proc: Path = PROC) -> int:
    return _kib(proc / str(pid) / "status", "VmHWM")


class MemoryPeaks:
    """Samples each side's summed PSS every `interval_s` on a thread, keeping the peak;
    `stop()` ends it and returns, per side, the peak PSS, each process's share of it at
    that sample (`at_peak_mib`, by `name[pid]`: which process holds what) and the summed
    VmHWM (MiB)."""

    def __init__(self, sides: Mapping[str, list[int]], interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}; a sampling interval is > 0")
        self.sides = dict(sides)
        self.interval_s = interval_s
        self.peak_pss_kib = dict.fromkeys(self.sides, 0)
        self.at_peak_kib: dict[str, dict[str, int]] = {side: {} for side in self.sides}
        self.hwm_kib: dict[str, dict[int, int]] = {side: {} for side in self.sides}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-peaks", daemon=True)

    def start(self) -> MemoryPeaks:
        self._thread.start()
        return self

    def sample(self) -> None:
        for side, sessions in self.sides.items():
            pids = session_pids(sessions)
            each = {f"{process_name(pid)}[{pid}]": pss_kib(pid) for pid in pids}
            total = sum(each.values())
            if total > self.peak_pss_kib[side]:
                self.peak_pss_kib[side] = total
                self.at_peak_kib[side] = each
            for pid in pids:  # VmHWM only grows: the last reading is the process's peak
                self.hwm_kib[side][pid] = max(self.hwm_kib[side].get(pid, 0), hwm_kib(pid))

    def _loop(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.sample()

    def stop(self) -> dict[str, dict[str, float]]:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sample()
        return {
            side: {
                "peak_pss_mib": self.peak_pss_kib[side] / 1024,
                "at_peak_mib": {name: kib / 1024 for name, kib in self.at_peak_kib[side].items()},
                "sum_peak_rss_mib": sum(self.hwm_kib[side].values()) / 1024,
                "processes": len(self.hwm_kib[side]),
            }
            for side in self.sides
        }
