"""`kvtier` command line: thin flag parsing over `kvtier.sim`.

`kvtier replay` with no arguments replays the built-in generated workload; this is
the README's first command, so its defaults must run in seconds and say something.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.cli.checks import (
    Given,
    ReportError,
    Terminated,
    allow_negative_lists,
    check_memory,
    inapplicable_flags,
    mix,
    reclaim_replay_dirs,
    stop_on_sigterm,
    unwritable_output,
    worker_counts,
)
from kvtier.cli.route import add_route_parser, run_route
from kvtier.router.scoring import POLICIES
from kvtier.sim.generator import GeneratorConfig
from kvtier.sim.traces import TraceFormatError
from kvtier.sim.workload import FORMATS


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="trace file (default: the built-in generated workload)")
    p.add_argument(
        "--format", action=Given, choices=FORMATS, default="mooncake", help="trace format"
    )
    p.add_argument(
        "--policy",
        action=Given,
        default="lru,arc",
        help="policy or comma list (default lru,arc)",
    )
    p.add_argument(
        "--store-threshold",
        action=Given,
        type=int,
        default=0,
        help="reuse filter: store a block once seen K>=2 times (0 or 1: off, as in vLLM)",
    )
    p.add_argument("--limit", type=_int_at_least(1), help="replay the first N requests only")
    p.add_argument(
        "--seed", action=Given, type=int, default=0, help="seed of the generated workload"
    )
    p.add_argument(
        "--requests",
        action=Given,
        type=_int_at_least(1),
        default=GeneratorConfig.num_requests,
        help="generated workload: number of requests",
    )
    p.add_argument(
        "--mix",
        action=Given,
        type=mix,
        default=",".join(str(x) for x in GeneratorConfig.mix),
        help="generated workload: shares of chats, agents, documents (e.g. 0.6,0.3,0.1)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--report", metavar="FILE.html", help="write an HTML report")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description="Replay KV-cache workloads through kvtier's tiers."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="replay one trace under one or more policies")
    _common(rp)
    rp.add_argument("--gpu-blocks", type=_int_at_least(0), default=0, help="0: no GPU tier")
    size = rp.add_mutually_exclusive_group()
    size.add_argument(
        "--cpu-blocks", action=Given, type=_int_at_least(0), help="CPU tier size in blocks"
    )
    size.add_argument(
        "--cpu-frac", action=Given, type=float, help="CPU tier as a fraction of unique blocks"
    )
    rp.add_argument(
        "--store-on",
        action=Given,
        choices=("compute", "evict"),
        default="compute",
        help="with a GPU tier: store to CPU once computed (vLLM) or on GPU eviction",
    )
    rp.add_argument(
        "--concurrent",
        action="store_true",
        help="overlap requests by arrival time (in-flight loads/stores, waiting for room)",
    )
    rp.add_argument(
        "--store-ms-per-block",
        metavar="local=MS,remote=MS",
        default="",
        help="with --concurrent: virtual ms each tier member (local: the CPU tier or the "
        "cascade; remote: Redis) takes to write a block; stores queue behind it",
    )
    rp.add_argument(
        "--store-queue-blocks",
        metavar="local=N,remote=N",
        default="",
        help="with --concurrent: the most blocks a member's store queue holds; a store "
        "past it is shed, counted as shed_blocks (with --vllm-config: the config's "
        "*_store_queue_bytes)",
    )
    rp.add_argument(
        "--disk-blocks", action=Given, type=_int_at_least(0), default=0, help="disk tier size"
    )
    rp.add_argument(
        "--disk-writes",
        action=Given,
        default="demote",
        help="write a block to disk when the CPU tier evicts it (demote, the default) or "
        "at every CPU store (write_through), as the engine's disk_writes",
    )
    rp.add_argument(
        "--disk-dir",
        metavar="PATH",
        help="keep the disk tier's files here across runs (with --data; prints what "
        "reopening found)",
    )
    rp.add_argument(
        "--data",
        action="store_true",
        help="move and verify real bytes (needs torch: pip install 'kvtier[torch]')",
    )
    rp.add_argument("--redis", action=Given, metavar="URL", help="add a shared Redis tier below")
    rp.add_argument(
        "--vllm-config",
        metavar="JSON|@FILE",
        help="replay the tiers of an engine's kv_connector_extra_config (needs --gpu-blocks "
        "and --kv-bytes-per-block or --model-config)",
    )
    rp.add_argument(
        "--kv-bytes-per-block",
        type=_int_at_least(1),
        help="with --vllm-config: one block's K and V bytes over all layers",
    )
    rp.add_argument(
        "--model-config",
        metavar="config.json",
        help="with --vllm-config: the model's config.json, for its KV bytes per block",
    )
    rp.add_argument(
        "--redis-namespace",
        action=Given,
        metavar="NAME",
        help="Redis key namespace (default: fresh per replay; share it to share blocks)",
    )
    rp.add_argument(
        "--engines",
        type=_int_at_least(1),
        default=1,
        help="replay N engines, each with these tiers, behind the router (see --router)",
    )
    rp.add_argument(
        "--engine-sizes",
        type=worker_counts,
        metavar="W,W,...",
        help="with --engines N: each engine's tensor-parallel workers (N counts, default 1 "
        "each); an engine of W workers has W times the --gpu/--cpu/--disk blocks, and every "
        "engine reads the shared Redis tier's blocks",
    )
    rp.add_argument(
        "--router",
        action=Given,
        choices=POLICIES,
        default="kv",
        help="with --engines N > 1: how requests are routed (default kv)",
    )
    cp = sub.add_parser("compare", help="sweep capacities x policies, plot against the bounds")
    _common(cp)
    cp.add_argument(
        "--fracs",
        default="0.01,0.05,0.1,0.25",
        help="capacities as fractions of the unique blocks (comma list)",
    )
    cp.add_argument("--png", metavar="FILE.png", help="write the plot as PNG")
    add_route_parser(sub)
    for p in (parser, rp, cp):
        allow_negative_lists(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "route":
        return run_route(args)
    problem = inapplicable_flags(args) or unwritable_output(args)
    if problem:
        print(f"kvtier {args.command}: error: {problem}", file=sys.stderr)
        return 2
    try:
        with stop_on_sigterm():
            document = _run(args)
    except ReportError as e:
        if args.json:  # the run's results are not lost with the report
            print(json.dumps(e.document, indent=2))
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (TraceFormatError, ValueError, KeyError, OSError) as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2
    except MemoryError:  # what the size checks did not foresee
        print(f"kvtier {args.command}: error: out of memory; give smaller sizes", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated): one line, no traceback
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"kvtier {args.command}: {how}", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    if args.json:
        print(json.dumps(document, indent=2))
    return 0


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.cli.checks import block_bytes_of

    check_memory(args, block_bytes_of(args))
    if args.command == "replay":
        from kvtier.cli.replay import run_replay

        if args.disk_blocks and args.data:
            reclaim_replay_dirs()  # what a SIGKILLed replay left behind
        return run_replay(args)
    from kvtier.cli.compare import run_compare

    return run_compare(args)
