"""The KV-aware router against round-robin, in front of two real vLLM servers.

    .venv/bin/python -m benchmarks.bench_router [--quick]

Writes benchmarks/results/router.json. Two vLLM OpenAI servers (the CPU build here;
a 24-layer model of Qwen2-0.5B's shape with dummy weights, or with --quick the engine tests' tiny
model), each with kvtier's CPU tier and its KV events on ZMQ, and `kvtier.router` in
front. The workload is the engine test's: multi-turn conversations
(`chat_workloads.multi_turn`), each turn the whole conversation so far plus a new user
message, sent one request at a time and streamed (`load_client.run_one_by_one`). The
two routers take turns on fresh conversations (round-robin, KV-aware, round-robin,
...: `--rounds` of each), on the same servers in the same run, so both see the same
machine. Reported per router: mean and p90 time to first token (the
client's, to the first streamed content) over every request and over returning turns,
and the prompt tokens the engines served from cache (`usage.prompt_tokens_details`).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.common import write_result
from kvtier.router import Router, RouterConfig, router_thread
from kvtier.vllm.engines import QWEN2_05B, TINY, ModelShape, write_model
from kvtier.vllm.engines.chat_workloads import multi_turn
from kvtier.vllm.engines.load_client import Answer, percentile, run_one_by_one
from kvtier.vllm.engines.openai_server import running_servers
from kvtier.vllm.engines.router_servers import (
    BLOCK,
    MAX_TOKENS,
    SERVED_NAME,
    engine_spec,
    router_configs,
)
from kvtier.vllm.engines.tokenizer import words, write_tokenizer

# Qwen2-0.5B's layers, hidden size and heads under the llama architecture, whose
# tokenizer class takes the word-level tokenizer the servers are given.
MODEL = replace(QWEN2_05B, architecture="llama")


def summary(turns: list[Answer]) -> dict[str, Any]:
    returning = [t for t in turns if t.turn > 0]
    ttft = [t.ttft_s for t in turns]
    back = [t.ttft_s for t in returning]
    return {
        "requests": len(turns),
        "answered": sum(t.ok for t in turns),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p90_s": percentile(ttft, 90),
        "returning_ttft_mean_s": statistics.fmean(back) if back else 0.0,
        "returning_ttft_p90_s": percentile(back, 90),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "cached_tokens": sum(t.cached_tokens for t in turns),
    }


def bench(workdir: Path, shape: ModelShape, conversations: int, turns: int,
          words_per_turn: int, rounds: int) -> dict[str, Any]:  # fmt: skip
    model = write_model(workdir / "model", shape, weights=False)
    write_tokenizer(model, shape.vocab)
    vocabulary = words(shape.vocab)
    runs: dict[str, list[Answer]] = {"round-robin": [], "kv": []}
    started = time.perf_counter()
    configs = router_configs(model, shape, workdir / "servers", pool_blocks=256)
    with running_servers(configs, workdir / "servers") as servers:
        start_s = time.perf_counter() - started
        specs = tuple(engine_spec(s) for s in servers.values())
        seed = 0
        for _ in range(rounds):
            for policy in runs:
                seed += 1
                config = RouterConfig(specs, BLOCK, str(model), policy=policy)
                talk = multi_turn(
                    vocabulary, conversations, turns, words_per_turn, MAX_TOKENS, seed
                )
                with router_thread(Router(config)) as port:
                    runs[policy] += run_one_by_one(f"http://127.0.0.1:{port}", SERVED_NAME, talk)
                print(f"   {policy:12s} round done: {summary(runs[policy])}", flush=True)
    rr, kv = summary(runs["round-robin"]), summary(runs["kv"])
    return {
        "model": shape.architecture,
        "layers": shape.layers,
        "hidden": shape.hidden,
        "block_size": BLOCK,
        "conversations": conversations,
        "turns": turns,
        "words_per_message": words_per_turn,
        "rounds": rounds,
        "servers_start_s": start_s,
        "round_robin": rr,
        "kv": kv,
        "cached_tokens_ratio": kv["cached_tokens"] / max(1, rr["cached_tokens"]),
        "ttft_mean_speedup": rr["ttft_mean_s"] / kv["ttft_mean_s"] if kv["ttft_mean_s"] else 0,
        "returning_ttft_mean_speedup": (
            rr["returning_ttft_mean_s"] / kv["returning_ttft_mean_s"]
            if kv["returning_ttft_mean_s"]
            else 0.0
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the tiny model, one round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of each router")
    args = parser.parse_args(argv)
    shape = TINY if args.quick else MODEL
    rounds = args.rounds or (1 if args.quick else 2)
    host = {"host": socket.gethostname(), "cpus": os.cpu_count(), "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-router-") as tmp, \
            warnings.catch_warnings():  # fmt: skip
        warnings.simplefilter("ignore")
        result = bench(
            Path(tmp), shape, conversations=5, turns=4, words_per_turn=200, rounds=rounds
        )
    print(write_result("router", {**host, **result}))
    for name in ("round_robin", "kv"):
        if result[name]["answered"] != result[name]["requests"]:
            raise SystemExit(f"{name}: requests went unanswered: {result[name]}")


if __name__ == "__main__":
    main()
