"""Timing engines against each other on a shared machine, so that a difference is theirs.

What made one engine look faster than another with nothing to do with what it cached
(measured for `make vllm-demo`, issue 28):

- CPU binding. vLLM's CPU build binds its worker's OpenMP threads to the node's cores
  less a reserve: one core per worker for its scheduler process, and one more per
  worker when the engine has a `kv_transfer_config` (meant for a P/D connector's
  threads). Where the cores are no more than that reserve it reserves none. On a
  2-core machine an engine without a connector computes on one core, one with kvtier
  on both: a cold 512-token prefill took ~155 ms against ~275 ms on a quiet machine,
  and 1-2.4 s against ~0.3 s while other processes kept the cores busy. `same_cpus_env`
  pins the reserve to the connector-less engine's, for every side.
- Order and the machine's other load, which comes and goes: engines run one after the
  other meet different loads (whole engines run A K K A, best of 2, still differed
  1.7x on cold prompts under a changing load). `stepwise.run_interleaved` keeps the
  sides' engines up together and alternates them request by request.
- vLLM's idle polling: a worker busy-polls a second after each step on its compute
  core, so a request that follows another engine's at once shares that core (the second
  of a pair took a median 2.2x the first). `stepwise.IDLE_S` of pause before each request.
- Warm-up: every engine serves the same warm-up prompt before its first request
  (`child`).

`cold_agreement` then checks the result: the requests that no side found in any cache
must take the same time on both sides, up to the noise (a sign test over the pairs).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.vllm.engines.job import JobResult

# vLLM's reserve without a connector, per worker (vllm/utils/ompmultiprocessing.py)
RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
# a side slower in this few or fewer of the pairs, by chance alone: the sides differ
SIGNIFICANCE = 0.05


def same_cpus_env(workers: int = 1) -> dict[str, str]:
    """The environment that gives an engine the CPU binding of one without a connector,
    whether or not it has one (`workers`: its tensor-parallel size)."""
    if workers < 1:
        raise ValueError(f"workers={workers}; an engine has at least one")
    return {RESERVED_CPUS_ENV: str(workers)}


@dataclass(frozen=True)
class Agreement:
    """How two sides' cold requests (nothing cached on either side) compare, pair by pair."""

    pairs: int  # cold requests served by both
    seconds: Mapping[str, float]  # per side: its cold requests' times, summed
    # the median over the pairs of the first side's time over the second's: unlike the
    # sums', one request that met a burst of the machine's other load does not move it
    median_ratio: float
    slower: Mapping[str, int]  # per side: the pairs in which it took longer
    p_value: float  # two-sided sign test: the chance of a split this uneven by noise alone

    @property
    def within_noise(self) -> bool:
        return self.p_value >= SIGNIFICANCE


def cold_agreement(results: Mapping[str, JobResult]) -> Agreement:
    """Compare two sides on the requests that neither found in a cache."""
    if len(results) != 2:
        raise ValueError(f"two sides to compare, got {sorted(results)}")
    (a, run_a), (b, run_b) = results.items()
    if [len(rnd) for rnd in run_a.rounds] != [len(rnd) for rnd in run_b.rounds]:
        raise ValueError(f"{a!r} and {b!r} served different requests")
    pairs = [
        (x, y)
        for rnd_a, rnd_b in zip(run_a.rounds, run_b.rounds, strict=True)
        for x, y in zip(rnd_a, rnd_b, strict=True)
        if x.num_cached_tokens == 0 and y.num_cached_tokens == 0
    ]
    if not pairs:
        raise ValueError("no request was cold on both sides: nothing to compare")
    slower = {a: sum(x.wall_s > y.wall_s for x, y in pairs)}
    slower[b] = sum(y.wall_s > x.wall_s for x, y in pairs)
    return Agreement(
        pairs=len(pairs),
        seconds={a: sum(x.wall_s for x, _ in pairs), b: sum(y.wall_s for _, y in pairs)},
        median_ratio=statistics.median(x.wall_s / y.wall_s for x, y in pairs),
        slower=slower,
        p_value=sign_test(*slower.values()),
    )


def sign_test(wins: int, losses: int) -> float:
    """Two-sided p-value of `wins` against `losses` when each is a coin flip (ties out)."""
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, j) for j in range(k + 1)) / (1 << n))
