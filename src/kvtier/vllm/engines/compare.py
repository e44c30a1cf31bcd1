"""Timing engines against each other on a shared machine, so that a difference is theirs.

Three things made one engine look faster than another with nothing to do with what
it cached (measured for `make vllm-demo`, issue 28):

- CPU binding. vLLM's CPU build binds its worker's OpenMP threads to the node's cores
  less a reserve: one core per worker for its scheduler process, and one more per
  worker when the engine has a `kv_transfer_config` (meant for a P/D connector's
  threads). Where the cores are no more than that reserve it reserves none. On a
  2-core machine an engine without a connector computes on one core, one with kvtier
  on both: a cold 512-token prefill took ~270 ms against ~155 ms. `same_cpus_env`
  pins the reserve to the connector-less engine's, for every side.
- Order and the machine's other load: sides run in a balanced order (`balanced_order`,
  A B B A ...) and each request is reported as the best of its repeats (`best_of`),
  the run least disturbed by whatever else the machine ran.
- Warm-up: every engine serves the same warm-up prompt before its first round
  (`child.serve`).

`cold_agreement` then checks the result: requests that no side found in any cache
must take the same time on every side, within the spread of one side's own repeats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.vllm.engines.job import EngineJob, JobResult, RequestResult
from kvtier.vllm.engines.run import run_job

# vLLM's reserve without a connector, per worker (vllm/utils/ompmultiprocessing.py)
RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def same_cpus_env(workers: int = 1) -> dict[str, str]:
    """The environment that gives an engine the CPU binding of one without a connector,
    whether or not it has one (`workers`: its tensor-parallel size)."""
    if workers < 1:
        raise ValueError(f"workers={workers}; an engine has at least one")
    return {RESERVED_CPUS_ENV: str(workers)}


def balanced_order(sides: Sequence[str], repeats: int) -> tuple[tuple[str, int], ...]:
    """(side, repeat) in the order to run them: forwards, then backwards, and so on
    (A B B A A B ...), so that over two repeats every side holds every position once
    and a drift of the machine's load favours none."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; at least 1")
    if len(set(sides)) != len(sides) or not sides:
        raise ValueError(f"sides {list(sides)}: give at least one, each once")
    order: list[tuple[str, int]] = []
    for repeat in range(repeats):
        ordered = sides if repeat % 2 == 0 else tuple(reversed(sides))
        order.extend((side, repeat) for side in ordered)
    return tuple(order)


def run_sides(
    jobs: Mapping[str, EngineJob],
    repeats: int,
    run: Callable[[str, int, EngineJob], JobResult] | None = None,
) -> dict[str, tuple[JobResult, ...]]:
    """Every side's job `repeats` times in `balanced_order`; each side's runs in the
    order they ran. `run(side, repeat, job)` runs one (default: `run_job(job)`)."""
    runs: dict[str, list[JobResult]] = {side: [] for side in jobs}
    for side, repeat in balanced_order(tuple(jobs), repeats):
        runs[side].append(run(side, repeat, jobs[side]) if run else run_job(jobs[side]))
    return {side: tuple(results) for side, results in runs.items()}


def best_of(runs: Sequence[JobResult]) -> tuple[tuple[RequestResult, ...], ...]:
    """Per round and request, the result of the run that served it fastest."""
    if not runs:
        raise ValueError("no runs to take the best of")
    shapes = {tuple(len(rnd) for rnd in run.rounds) for run in runs}
    if len(shapes) != 1:
        raise ValueError(f"runs of different jobs (requests per round: {sorted(shapes)})")
    return tuple(
        tuple(
            min((run.rounds[r][i] for run in runs), key=lambda result: result.wall_s)
            for i in range(len(runs[0].rounds[r]))
        )
        for r in range(len(runs[0].rounds))
    )


def cached_tokens(runs: Sequence[JobResult], r: int, i: int) -> tuple[int, int]:
    """The fewest and most tokens request `i` of round `r` found cached over `runs`
    (they differ when an asynchronous store finished in one run and not another)."""
    counts = [run.rounds[r][i].num_cached_tokens for run in runs]
    return min(counts), max(counts)


@dataclass(frozen=True)
class Agreement:
    """How far the sides' cold requests (nothing cached on any side) differ."""

    requests: int  # cold requests compared
    seconds: Mapping[str, float]  # per side: its cold requests' best times, summed
    ratio: float  # the slowest side's sum over the fastest's
    noise: float | None  # the largest ratio between two runs of one side; None: 1 run each

    @property
    def within_noise(self) -> bool | None:
        return None if self.noise is None else self.ratio <= self.noise


def cold_agreement(runs: Mapping[str, Sequence[JobResult]]) -> Agreement:
    """Compare the sides on the requests no run of any side found in a cache.

    The noise is what the machine alone makes of the same requests: the largest ratio
    between two runs of one side (their cold requests' times summed).
    """
    all_runs = [run for side_runs in runs.values() for run in side_runs]
    if not all_runs:
        raise ValueError("no runs to compare")
    best = {side: best_of(side_runs) for side, side_runs in runs.items()}
    cold = [
        (r, i)
        for r, rnd in enumerate(all_runs[0].rounds)
        for i in range(len(rnd))
        if cached_tokens(all_runs, r, i)[1] == 0
    ]
    if not cold:
        raise ValueError("no request was cold on every side: nothing to compare")
    seconds = {side: sum(b[r][i].wall_s for r, i in cold) for side, b in best.items()}
    spreads = [
        max(totals) / min(totals)
        for side_runs in runs.values()
        if len(side_runs) > 1
        for totals in [[sum(run.rounds[r][i].wall_s for r, i in cold) for run in side_runs]]
    ]
    return Agreement(
        requests=len(cold),
        seconds=seconds,
        ratio=max(seconds.values()) / min(seconds.values()),
        noise=max(spreads) if spreads else None,
    )
