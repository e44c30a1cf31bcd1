"""`kvtier replay --engines N`: N engines' stacks behind the router's routing code."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.cli.args import open_workload_from_args
from kvtier.router.replay import EnginesResult, replay_engines
from kvtier.sim.replay_config import ReplayConfig
from kvtier.sim.session import parse_policies


def run_engines(args: argparse.Namespace, config: ReplayConfig) -> dict[str, Any]:
    workload = open_workload_from_args(args)
    sizes = args.engine_sizes
    results = [
        replay_engines(
            workload, replace(config, policy=policy), args.engines, args.router, sizes=sizes
        )
        for policy in parse_policies(args.policy)
    ]
    if not args.json:
        console = Console()
        for result in results:
            console.print(_table(workload.name, result))
    return {
        "trace": workload.name,
        "requests": len(workload.requests),
        "engines": args.engines,
        "engine_sizes": list(sizes or [1] * args.engines),
        "router": args.router,
        "results": [r.to_json() for r in results],
    }


def _table(trace: str, result: EnginesResult) -> Table:
    table = Table(
        title=f"{trace}: {len(result.engines)} engines, router {result.router}, "
        f"policy {result.policy}"
    )
    columns = ("engine", "workers", "requests", "block refs", "prefix hits", "prefix hit rate")
    for column in columns:
        table.add_column(column, justify="right")
    tiers = list(result.engines[0].tier_hits)
    for tier in tiers:
        table.add_column(f"{tier} hits", justify="right")
    for e in result.engines:
        table.add_row(
            e.name, str(e.workers), str(e.requests), str(e.block_refs), str(e.prefix_hit_blocks),
            f"{e.prefix_hit_rate:.4f}", *(str(e.tier_hits[t]) for t in tiers),
        )  # fmt: skip
    totals = [sum(e.tier_hits[t] for e in result.engines) for t in tiers]
    table.add_row(
        "total", str(sum(e.workers for e in result.engines)),
        str(sum(e.requests for e in result.engines)), str(result.block_refs),
        str(result.prefix_hit_blocks), f"{result.prefix_hit_rate:.4f}", *map(str, totals),
    )  # fmt: skip
    b = result.bounds
    table.caption = (
        f"bounds at {b.capacity} blocks in all: infinite prefix {b.infinite_prefix:.4f}, "
        f"Belady {b.belady:.4f}"
        + (f"; unschedulable requests: {result.unschedulable}" if result.unschedulable else "")
    )
    return table
