"""Flags shared by the subcommands, turned into `kvtier.sim` objects."""

from __future__ import annotations

import argparse

from kvtier.sim.generator import GeneratorConfig
from kvtier.sim.session import open_workload
from kvtier.sim.workload import Workload


def open_workload_from_args(args: argparse.Namespace) -> Workload:
    """The trace named by --trace, or the generated workload shaped by --requests/--mix
    (only the first --limit requests are generated: the rest would be cut anyway)."""
    generator = None
    if args.trace is None:
        wanted = min(args.requests, args.limit or args.requests)
        generator = GeneratorConfig(num_requests=wanted, mix=args.mix)
    return open_workload(
        args.trace, args.format, limit=args.limit, seed=args.seed, generator=generator
    )
