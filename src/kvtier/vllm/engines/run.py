"""Starting an engine in a child process (`python -m kvtier.vllm.engines.child JOB OUT`).

vLLM spawns its engine core and worker processes, sets thread and NUMA bindings, and
holds gigabytes; a child keeps all of that out of the caller (a test session, the demo)
and ends it for sure. One engine start (~20-60 s on 2 cores) serves a whole job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import kvtier
from kvtier.vllm.engines.job import EngineJob, JobResult

CHILD_MODULE = "kvtier.vllm.engines.child"


def run_job(job: EngineJob, *, timeout_s: float = 900, workdir: Path | None = None) -> JobResult:
    """Start an engine in a child process, serve the job, return what it produced.

    The child and every process vLLM spawns share a new session, which is killed on a
    timeout, so no engine outlives the call. After a clean exit the call waits for the
    session's last processes (multiprocessing's resource tracker) to end, so that an
    engine started next shares the cores with no leftovers of this one.
    """
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-", dir=workdir) as tmp:
        job_path, out_path, log_path = (Path(tmp) / n for n in ("job.json", "out.json", "log"))
        job_path.write_text(json.dumps(job.to_json()))
        with log_path.open("w") as log_file:
            proc = spawn_child([str(job_path), str(out_path)], log_file)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
            end_session(proc.pid)
        log = log_path.read_text(errors="replace")
        if code != 0 or not out_path.exists():
            why = "timed out" if code is None else f"exited with {code}"
            raise RuntimeError(f"engine job {why}; its log ends:\n{log[-6000:]}")
        names = tuple(r.name for r in job.rounds)
        return JobResult.from_json(json.loads(out_path.read_text()), log, names)


def spawn_child(args: list[str], log: IO[str], **popen: Any) -> subprocess.Popen[str]:
    """`python -m kvtier.vllm.engines.child ARGS` in a new session (its own and every
    process vLLM spawns: one kill ends them all), its output into `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", CHILD_MODULE, *args],
        env={**os.environ, "PYTHONPATH": _pythonpath()},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
        **popen,
    )


def end_session(session: int, grace_s: float = 10.0) -> None:
    """Wait (at most `grace_s`) for every process of `session` to exit, then kill those left."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(session, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(session, signal.SIGKILL)


def _pythonpath() -> str:
    """The child (and the engine processes vLLM spawns, which load kvtier's connector)
    import the kvtier the caller imported, not another installed copy."""
    parts = [str(Path(kvtier.__file__).resolve().parents[1])]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)
