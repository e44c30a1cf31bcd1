"""`kvtier compare`: a capacities x policies sweep, as a table, a PNG and HTML."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from kvtier.cli.args import open_workload_from_args
from kvtier.cli.checks import ReportError
from kvtier.cli.render import progress_bars, sweep_table
from kvtier.sim.replay_config import ReplayConfig
from kvtier.sim.session import capacities_from_fractions, parse_policies, sweep


def _fractions(text: str) -> list[float]:
    try:
        values = [float(f) for f in text.split(",") if f.strip()]
    except ValueError:
        raise ValueError(f"--fracs must be a comma list of numbers, got {text!r}") from None
    if not values:
        raise ValueError("--fracs names no capacity")
    return values


def run_compare(args: argparse.Namespace) -> dict[str, Any]:
    policies = parse_policies(args.policy)
    fractions = _fractions(args.fracs)
    workload = open_workload_from_args(args)
    capacities = capacities_from_fractions(workload, fractions)
    console = Console(stderr=args.json)
    config = ReplayConfig(store_threshold=args.store_threshold)
    with progress_bars(console, enabled=not args.json) as bars:
        report = sweep(workload, policies, capacities, config, bars)
    if not args.json:
        console.print(sweep_table(report))
    if args.png or args.report:
        from kvtier.cli.report import sweep_png, sweep_rows, write_html, write_output

        png = sweep_png(report)
        try:
            if args.png:
                write_output(args.png, png)
            if args.report:
                write_html(args.report, f"kvtier compare: {report.trace}", sweep_rows(report), png)
        except OSError as e:
            raise ReportError(str(e), report.to_json()) from None
    return report.to_json()
