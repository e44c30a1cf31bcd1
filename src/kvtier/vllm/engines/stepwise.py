"""Engines kept running side by side and asked for one request at a time.

`run_interleaved` starts one engine per side and serves the sides' jobs request by
request, alternating which side goes first (A B, B A, A B, ...), each request after a
pause with every engine idle (`IDLE_S`): on a machine whose other load comes and goes,
each pair of the same request meets the same moment's load, where whole engines run
one after the other meet different ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol

from kvtier.vllm.engines.job import EngineJob, JobResult, RequestResult
from kvtier.vllm.engines.run import end_session, spawn_child


class StepwiseEngine:
    """One engine in a child process (`child.serve_stepwise`), serving on request."""

    def __init__(self, job: EngineJob, workdir: Path, timeout_s: float) -> None:
        self.job, self.timeout_s = job, timeout_s
        job_path, self.log_path = workdir / "job.json", workdir / "log"
        job_path.write_text(json.dumps(job.to_json()))
        read_fd, write_fd = os.pipe()
        self._replies, self._buffer = read_fd, b""
        with self.log_path.open("w") as log_file:
            args = ["--stepwise", str(job_path), str(write_fd)]
            self.proc = spawn_child(args, log_file, stdin=subprocess.PIPE, pass_fds=(write_fd,))
        os.close(write_fd)

    def started(self) -> float:
        """Wait for the engine to be up and warmed up; its start time."""
        start_s: float = self._reply()["start_s"]
        return start_s

    def request(self, r: int, i: int) -> RequestResult:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([r, i]) + "\n")
        self.proc.stdin.flush()
        return RequestResult.from_json(self._reply())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        """End the engine: the end of its commands, then a kill if it does not exit."""
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        end_session(self.proc.pid)
        os.close(self._replies)

    def _reply(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._replies], [], [], max(left, 0.0))
            chunk = os.read(self._replies, 1 << 16) if ready else b""
            if not chunk:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                why = "timed out" if not ready else "ended"
                raise RuntimeError(f"engine {why}; its log ends:\n{self.log()[-6000:]}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply


def interleaved_order(sides: tuple[str, ...], requests: int) -> Iterator[tuple[int, str]]:
    """(request, side): every request on every side, the sides' order reversed from one
    request to the next, so that neither side always goes first."""
    if not sides or len(set(sides)) != len(sides):
        raise ValueError(f"sides {list(sides)}: give at least one, each once")
    for k in range(requests):
        for side in sides if k % 2 == 0 else tuple(reversed(sides)):
            yield k, side


class Engine(Protocol):
    """What `serve_interleaved` asks of an engine (`StepwiseEngine`, or a fake)."""

    def started(self) -> float: ...
    def request(self, r: int, i: int) -> RequestResult: ...
    def log(self) -> str: ...


# vLLM's workers busy-poll their input queue for a second after each step
# (`busy_loop_s` in vllm/distributed/device_communicators/shm_broadcast.py), on the core
# their compute is bound to: an engine's request that follows another engine's at once
# shares that core with the other's polling (measured in the demo on a busy machine:
# the second of a cold pair took a median 2.2x the first, whichever side it was; 1.01x
# with this pause). A pause longer than the polling before each request starts every
# request with every engine idle.
IDLE_S = 1.5


def run_interleaved(
    jobs: Mapping[str, EngineJob],
    *,
    idle_s: float = IDLE_S,
    timeout_s: float = 1800,
    workdir: Path | None = None,
) -> dict[str, JobResult]:
    """Start one engine per side (all at once), then serve the jobs' requests in
    `interleaved_order`, each after `idle_s`. The jobs must have the same rounds' sizes."""
    _positions(jobs)  # checked before any engine starts
    with _engines(jobs, timeout_s, workdir) as engines:
        return serve_interleaved(jobs, engines, idle_s=idle_s)


def serve_interleaved(
    jobs: Mapping[str, EngineJob], engines: Mapping[str, Engine], *, idle_s: float = 0.0
) -> dict[str, JobResult]:
    """Each side's job on its engine, the requests in `interleaved_order`."""
    positions = _positions(jobs)
    start_s = {side: engines[side].started() for side in jobs}
    served: dict[str, list[RequestResult]] = {side: [] for side in jobs}
    for k, side in interleaved_order(tuple(jobs), len(positions)):
        time.sleep(idle_s)
        served[side].append(engines[side].request(*positions[k]))
    results = {}
    for side, job in jobs.items():
        rounds = tuple(
            tuple(served[side][k] for k, (r, _) in enumerate(positions) if r == rnd)
            for rnd in range(len(job.rounds))
        )
        names = tuple(r.name for r in job.rounds)
        results[side] = JobResult(start_s[side], rounds, engines[side].log(), names)
    return results


def _positions(jobs: Mapping[str, EngineJob]) -> list[tuple[int, int]]:
    """(round, request) of every request, in order; the same for every job."""
    shapes = {tuple(len(r.prompts) for r in job.rounds) for job in jobs.values()}
    if len(shapes) != 1:
        raise ValueError(f"jobs of different shapes (requests per round: {sorted(shapes)})")
    return [(r, i) for r, n in enumerate(shapes.pop()) for i in range(n)]


@contextmanager
def _engines(
    jobs: Mapping[str, EngineJob], timeout_s: float, workdir: Path | None
) -> Iterator[dict[str, StepwiseEngine]]:
    with ExitStack() as stack:
        engines = {}
        for side, job in jobs.items():
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=workdir)))
            engine = StepwiseEngine(job, tmp, timeout_s)
            stack.callback(engine.close)
            engines[side] = engine
        yield engines
