"""The router's weights, measured by replay: where the defaults come from.

    .venv/bin/python -m benchmarks.bench_router_weights [--quick]

Writes benchmarks/results/router_weights.json. The public conversation trace over 8
engines (`kvtier replay --engines 8`, each with a 1,000-block pool and a 2,000-block
LRU CPU tier), routed by the KV-aware router under a grid of load weights x CPU-tier
weights, round-robin measured in the same run as the baseline. Reported per point:
the prefix hit rate over all engines, the blocks the pools and the CPU tiers served,
and the busiest engine's share of the requests. (--quick: the first 3,000 requests.)
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from benchmarks.common import CONVERSATION_TRACE, write_result
from kvtier.router.replay import EnginesResult, replay_engines
from kvtier.router.scoring import Weights
from kvtier.sim import ReplayConfig, load_workload

LOADS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5)
CPU_WEIGHTS = (0.5, 0.8, 1.0)
ENGINES = 8


def point(result: EnginesResult) -> dict[str, Any]:
    requests = [e.requests for e in result.engines]
    return {
        "prefix_hit_rate": result.prefix_hit_rate,
        "gpu_hit_blocks": sum(e.tier_hits["gpu"] for e in result.engines),
        "cpu_hit_blocks": sum(e.tier_hits["cpu"] for e in result.engines),
        "busiest_share": max(requests) / max(1, sum(requests)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the first 3,000 requests")
    args = parser.parse_args(argv)
    workload = load_workload(CONVERSATION_TRACE, limit=3000 if args.quick else None)
    config = ReplayConfig(gpu_blocks=1000, cpu_blocks=2000, policy="lru")
    baseline = point(replay_engines(workload, config, ENGINES, "round-robin"))
    print(f"round-robin: {baseline}", flush=True)
    grid = []
    for load, cpu in itertools.product(LOADS, CPU_WEIGHTS):
        result = replay_engines(workload, config, ENGINES, "kv", Weights(cpu=cpu, load=load))
        grid.append({"load": load, "cpu": cpu, **point(result)})
        print(f"load {load:<5} cpu {cpu:<4} {grid[-1]}", flush=True)
    best = max(grid, key=lambda p: p["prefix_hit_rate"])
    defaults = Weights()
    at_defaults = next(p for p in grid if (p["load"], p["cpu"]) == (defaults.load, defaults.cpu))
    print(write_result("router_weights", {
        "trace": str(CONVERSATION_TRACE.name), "requests": len(workload.requests),
        "engines": ENGINES, "quick": args.quick, "round_robin": baseline, "grid": grid,
        "best": best, "defaults": at_defaults,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
