"""`kvtier replay`: flags -> `ReplayConfig` -> `run_replays` -> table / JSON / HTML."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from rich.console import Console

from kvtier.cli.args import open_workload_from_args
from kvtier.cli.checks import ReportError
from kvtier.cli.render import fault_lines, progress_bars, replay_table, tier_table
from kvtier.sim.replay_config import ReplayConfig, TimeModel
from kvtier.sim.session import parse_policies, run_replays
from kvtier.sim.store_queues import StoreQueueModel


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    return ReplayConfig(
        gpu_blocks=args.gpu_blocks,
        cpu_blocks=args.cpu_blocks,
        cpu_frac=args.cpu_frac,
        store_threshold=args.store_threshold,
        time_model=TimeModel() if args.concurrent else None,
        store_on=args.store_on,
        disk_blocks=args.disk_blocks,
        disk_writes=args.disk_writes,
        disk_dir=args.disk_dir,
        data=args.data,
        redis_url=args.redis,
        redis_namespace=args.redis_namespace,
        store_queues=store_queues_from_args(args),
    )


def store_queues_from_args(
    args: argparse.Namespace, local_blocks: int | None = None, remote_blocks: int | None = None
) -> StoreQueueModel | None:
    """The members' store queues the flags ask for (None: no flag, nothing shed); the
    bounds given here (an engine config's) apply where `--store-queue-blocks` names none."""
    rates, bounds = args.store_ms_per_block, args.store_queue_blocks
    if not (rates.strip() or bounds.strip()):
        return None
    if not args.concurrent:
        raise ValueError(
            "--store-ms-per-block and --store-queue-blocks drain in virtual time: add --concurrent"
        )
    model = StoreQueueModel.parse(rates, bounds)
    if model.local_max_blocks is None and local_blocks is not None:
        model = replace(model, local_max_blocks=local_blocks)
    if model.remote_max_blocks is None and remote_blocks is not None:
        model = replace(model, remote_max_blocks=remote_blocks)
    return model


def run_replay(args: argparse.Namespace) -> dict[str, Any]:
    if args.vllm_config is None:  # bad flags are refused before the workload is read
        config = config_from_args(args)
        if args.engines > 1:
            from kvtier.cli.engines import run_engines

            return run_engines(args, config)
        policies = parse_policies(args.policy)
        workload = open_workload_from_args(args)
    else:  # the budgets in bytes become blocks of the workload's size
        from kvtier.cli.vllm_config import replay_config

        workload = open_workload_from_args(args)
        config = replay_config(args, workload.block_size)
        policies = (config.policy,)
    console = Console(stderr=args.json)
    with progress_bars(console, enabled=not args.json) as bars:
        report = run_replays(workload, policies, config, bars)
    if not args.json:
        console.print(replay_table(report))
        tiers = tier_table(report)
        if tiers is not None:
            console.print(tiers)
        for line in fault_lines(report):
            console.print(line, soft_wrap=True, highlight=False, markup=False)
    if args.report:
        from kvtier.cli.report import replay_png, replay_rows, tier_rows, write_html

        title = f"kvtier replay: {report.trace}"
        png = replay_png(report)
        try:
            write_html(args.report, title, replay_rows(report), png, tier_rows(report))
        except OSError as e:
            raise ReportError(str(e), report.to_json()) from None
        if not args.json:
            console.print(f"report written to {args.report}")
    return report.to_json()
