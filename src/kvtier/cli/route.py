"""`kvtier route`: flags -> `RouterConfig` -> the router, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvtier.cli.checks import Terminated, stop_on_sigterm
from kvtier.router.config import EngineSpec, RouterConfig
from kvtier.router.scoring import POLICIES, Weights

_WEIGHTS = ("gpu", "cpu", "disk", "shared", "load")


def add_route_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "route",
        help="KV-aware OpenAI-compatible router in front of vLLM servers",
        description="Route OpenAI requests to the vLLM server that holds the longest "
        "prefix of their prompt (in any tier), from the servers' KV events. The servers "
        "must run with --prefix-caching-hash-algo sha256_cbor and the same block size.",
    )
    p.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="URL[,EVENTS[,REPLAY]]",
        help="a vLLM server, its --kv-events-config endpoint and replay_endpoint "
        "(repeat per server)",
    )
    p.add_argument("--topic", default="", help="the publishers' topic (default: none)")
    p.add_argument(
        "--bind-events",
        action="store_true",
        help="bind the events endpoints (the servers' publishers connect to them)",
    )
    p.add_argument("--model-dir", help="the model's directory: its tokenizer and chat template")
    p.add_argument("--block-size", type=int, default=16, help="the servers' block size")
    p.add_argument("--hash-seed", help="the servers' PYTHONHASHSEED, if they set one")
    p.add_argument("--policy", choices=POLICIES, default="kv", help="routing policy")
    p.add_argument(
        "--weights",
        default="",
        metavar="NAME=X,...",
        help="tier and load weights, e.g. gpu=1,cpu=0.8,disk=0.5,shared=0.3,load=0.1",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--request-timeout", type=float, default=120.0, metavar="S")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="S")
    p.add_argument(
        "--routed-ttl",
        type=float,
        default=10.0,
        metavar="S",
        help="a prompt just routed counts as in its engine's pool until the engine's "
        "KV events name its blocks, for at most S seconds (0: wait for the events)",
    )


def parse_engine(text: str, topic: str, bind: bool) -> EngineSpec:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 3 or not parts[0]:
        raise ValueError(f"--engine {text!r}: expected URL[,EVENTS[,REPLAY]]")
    events = parts[1] if len(parts) > 1 and parts[1] else None
    replay = parts[2] if len(parts) > 2 and parts[2] else None
    return EngineSpec(parts[0], events, replay, topic=topic, bind_events=bind)


def parse_weights(text: str) -> Weights:
    values: dict[str, float] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in _WEIGHTS:
            raise ValueError(f"--weights {item!r}: expected NAME=X with NAME in {_WEIGHTS}")
        try:
            values[name] = float(value)
        except ValueError:
            raise ValueError(f"--weights {item!r}: {value!r} is not a number") from None
    return Weights(**values)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    engines = tuple(parse_engine(e, args.topic, args.bind_events) for e in args.engine)
    return RouterConfig(
        engines,
        block_size=args.block_size,
        model_dir=args.model_dir,
        hash_seed=args.hash_seed,
        policy=args.policy,
        weights=parse_weights(args.weights),
        request_timeout_s=args.request_timeout,
        health_interval_s=args.health_interval,
        routed_ttl_s=args.routed_ttl,
    )


def run_route(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"kvtier route: error: {e}", file=sys.stderr)
        return 2
    try:
        from kvtier.router.proxy import serve
    except ModuleNotFoundError as e:
        print(
            f"kvtier route: error: {e.name} is missing: pip install 'kvtier[router]'",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    try:
        with stop_on_sigterm():
            asyncio.run(serve(config, args.host, args.port))
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated): the router stopped
        return 143 if isinstance(e, Terminated) else 130
    except OSError as e:  # the port is taken, an endpoint cannot be bound
        print(f"kvtier route: error: {e}", file=sys.stderr)
        return 2
    return 0
