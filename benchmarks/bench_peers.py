"""kvtier side by side with LMCache and vLLM alone in the same vLLM engine (issue 34).

    make peers   # LMCache 0.5.6 in .venv-peers, over the project's vLLM
    flock -x ../engine.lock .venv/bin/python -m benchmarks.bench_peers [--quick]
        [--only load|restart] [--repeats N] [--rows random,multi_turn,...]
    .venv/bin/python -m benchmarks.bench_peers --table benchmarks/results/peers-load.json

Writes benchmarks/results/peers.json (peers-load.json, peers-restart.json with --only;
peers-quick.json with --quick, which has no restart row). The sides
(`peer_sides`): vLLM alone, kvtier's CPU tier, LMCache's multiprocess server; vLLM's own
`OffloadingConnector` too where its platform runs it (a GPU build; here the result says
why not). Every side is the same vLLM build, model, pool, flags, CPU binding and warm-up,
and holds the same bytes of offloaded KV; the servers start together and stay up, and
the sides take turns, one at a time, the side going first rotating from run to run
(`peer_figures.side_orders`), each run after `POST /reset_prefix_cache` (the engine's
pool and the connector's store: kvtier's tiers, LMCache's L1).

Rows:
1. vLLM's own serving benchmark client (`vllm.benchmarks.serve`, the code of `vllm bench
   serve`) on its `prefix_repetition` dataset (shared prefixes 1.5x the engine's pool)
   and its `random` one (no reuse), at a few rates and all at once: requests/s and TTFT
   mean, p50, p90, p99;
2. the project's multi-turn and documents workloads (`chat_workloads`, as in
   bench_serving, smaller), through `load_client`;
3. a returning 4,096-token prompt on the 0.5B-shaped model from each side's CPU store
   and from its local disk after a restart, against recompute (`peer_restart`, one
   engine at a time; `--repeats` returns from CPU memory and as many restarts);
4. peak memory of each side's processes (`peer_memory`: the engine and its engine core;
   LMCache's server too);
5. each run's hits from each side's own counters: vLLM's pool and external prefix-cache
   tokens, kvtier's per-tier blocks, LMCache's lookup and L1 counters; a run whose
   counters contradict its side (no tier hits on a reuse workload, prompts that differ
   from the first side's) is listed under `problems`.

At saturation on the reuse rows, `ceilings` bounds kvtier's lead over LMCache by the
prompt tokens each side had to compute (`peer_figures.saturation_ceilings`).

The whole grid is played `--repeats` times (repeats outermost, so that the machine's load
changes between them); each figure's spread over the repeats is reported, and a
verdict is met only by more than that spread (`peer_figures.verdicts`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.bench_serving import BLOCK
from benchmarks.common import REPO_ROOT, write_result
from benchmarks.peer_figures import (
    LMCACHE_COUNTERS,
    VLLM_COUNTERS,
    ClientFigures,
    counters,
    delta,
    fairness_problems,
    markdown_table,
    saturation_ceilings,
    side_orders,
    verdicts,
)
from benchmarks.peer_memory import MemoryPeaks
from benchmarks.peer_restart import restart_row
from benchmarks.peer_setups import INF, ClientDataset, Setup, full_setup, quick_setup
from benchmarks.peer_sides import (
    LMCACHE_VERSION,
    LMCacheServer,
    LMCacheSettings,
    offloading_runs_here,
    side_configs,
)
from kvtier.vllm.engines import write_model
from kvtier.vllm.engines.chat_workloads import Workload, unique
from kvtier.vllm.engines.load_client import Answer, LoadSummary, run_load, run_one_by_one
from kvtier.vllm.engines.openai_server import (
    OpenAIServer,
    ServerConfig,
    kvtier_counters,
    running_servers,
)
from kvtier.vllm.engines.tokenizer import words, write_tokenizer

# a row's run: (row, reuse, offered rate, requests, the side's play of it)
Play = tuple[str, bool, float, int, Callable[[OpenAIServer], ClientFigures]]


def play_client(server: OpenAIServer, model: Path, dataset: ClientDataset, rate: float) -> Any:
    """One run of vLLM's serving benchmark client, in this process (its import, vLLM's,
    costs seconds once); its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        ["--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
         "--model", str(model), "--served-model-name", server.config.served_name,
         "--tokenizer", str(model), "--dataset-name", dataset.name, *dataset.flags,
         "--num-prompts", str(dataset.prompts), "--request-rate", str(rate), "--seed", "0",
         "--temperature", "0", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl",
         "--metric-percentiles", "50,90,99", "--disable-tqdm"]
    )  # fmt: skip
    return main(args)


def chat_figures(answers: list[Answer]) -> ClientFigures:
    """load_client's summary as the serving client's figures, with the TTFT mean."""
    s = LoadSummary.of(answers)
    ok = [a for a in answers if a.ok]
    return ClientFigures(
        completed=len(ok),
        failed=s.failed,
        input_tokens=s.prompt_tokens,
        output_tokens=sum(a.output_tokens for a in ok),
        requests_per_s=s.requests_per_s,
        ttft_mean_s=statistics.fmean(a.ttft_s for a in ok) if ok else 0.0,
        ttft_p50_s=s.ttft_p50_s,
        ttft_p90_s=s.ttft_p90_s,
        ttft_p99_s=s.ttft_p99_s,
    )


class Bench:
    """The servers of one run of the benchmark and what each side's counters say."""

    def __init__(self, servers: Mapping[str, OpenAIServer], lmcache: LMCacheServer) -> None:
        self.servers = servers
        self.lmcache = lmcache

    def scrape(self, side: str) -> dict[str, Any]:
        scrape = self.servers[side].get("/metrics")
        own = counters(self.lmcache.metrics(), LMCACHE_COUNTERS) if side == "lmcache" else {}
        return {
            "engine": counters(scrape, VLLM_COUNTERS),
            "tiers": kvtier_counters(scrape),
            "own": own,
        }

    def run(self, side: str, play: Callable[[OpenAIServer], ClientFigures]) -> dict[str, Any]:
        server = self.servers[side]
        server.reset()
        before = self.scrape(side)
        figures = play(server)
        time.sleep(1.5)  # vLLM's stats reach /metrics a logging interval late
        after = self.scrape(side)
        tiers = {
            tier: {
                k: v
                for k, v in delta(before["tiers"].get(tier, {}), values).items()
                if not k.startswith(("capacity", "used", "breaker", "lookup_seconds"))
            }
            for tier, values in after["tiers"].items()
        }
        if side == "kvtier":  # its own count of tokens served, in the engine's blocks
            own = {"hit_tokens": sum(t.get("load_blocks", 0.0) for t in tiers.values()) * BLOCK}
        else:
            own = delta(before["own"], after["own"])
        return {
            "client": figures,
            "engine": delta(before["engine"], after["engine"]),
            "tiers": tiers,
            "own": own,
        }


def play_grid(bench: Bench, plays: list[Play], repeats: int) -> list[dict[str, Any]]:
    """Every (row, rate) `repeats` times, repeats outermost, the sides rotating."""
    sides = list(bench.servers)
    orders = side_orders(sides, repeats * len(plays))
    runs = []
    for r in range(repeats):
        for p, (row, reuse, rate, expected, play) in enumerate(plays):
            order = orders[r * len(plays) + p]
            entry: dict[str, Any] = {
                "row": row,
                "rate": None if rate == INF else rate,
                "repeat": r,
                "order": list(order),
            }
            for side in order:
                entry[side] = bench.run(side, play)
                print(f"  {row} rate {rate} repeat {r} {side}: {_brief(entry[side])}", flush=True)
            reference = entry[sides[0]]["client"]
            for side in sides:
                got = entry[side]
                got["problems"] = fairness_problems(
                    side, reuse, got["client"], got["engine"], got["own"], reference, expected
                )
                got["client"] = asdict(got["client"])
            runs.append(entry)
    return runs


def _brief(got: dict[str, Any]) -> str:
    c: ClientFigures = got["client"]
    return (
        f"{c.requests_per_s:.3f} req/s, TTFT mean/p90 {c.ttft_mean_s:.2f}/{c.ttft_p90_s:.2f} s, "
        f"external hits {got['engine'].get('external_hits', 0):.0f}, "
        f"pool hits {got['engine'].get('pool_hits', 0):.0f} tokens"
    )


def summarize(runs: list[dict[str, Any]], reuse: dict[str, bool]) -> dict[str, Any]:
    """Per row: each rate's verdicts, from the repeats' figures."""
    out: dict[str, Any] = {}
    for row in dict.fromkeys(r["row"] for r in runs):
        by_rate: dict[float, dict[str, list[ClientFigures]]] = {}
        for run in (r for r in runs if r["row"] == row):
            rate = INF if run["rate"] is None else run["rate"]
            for side in run["order"]:
                figures = ClientFigures(**run[side]["client"])
                by_rate.setdefault(rate, {}).setdefault(side, []).append(figures)
        out[row] = verdicts(by_rate, reuse[row])
    return out


def bench(
    setup: Setup,
    workdir: Path,
    peers_bin: Path,
    repeats: int,
    lmcache_chunk: int,
    eviction: str,
    rows: Collection[str] = (),
) -> dict[str, Any]:
    """The load rows (all, or only `rows`: each keeps the workload it has in the grid)."""
    model = write_model(workdir / "model", setup.shape, weights=False)
    write_tokenizer(model, setup.shape.vocab)
    # a capacity for every side: 32x the engine's pool, in whole MiB for LMCache
    cpu_bytes = 32 * setup.pool_blocks * setup.shape.kv_bytes(BLOCK)
    settings = LMCacheSettings(lmcache_chunk, eviction, l1_bytes=cpu_bytes)
    alone = ServerConfig(
        model, BLOCK, pool_blocks=setup.pool_blocks, max_model_len=setup.max_model_len
    )
    offloading, why = offloading_runs_here(sys.executable)
    out: dict[str, Any] = {
        "lmcache": {"version": LMCACHE_VERSION, **asdict(settings)},
        "cpu_bytes": cpu_bytes,
        "offloading": {"runs": offloading, "why": why},
    }
    with LMCacheServer(peers_bin, settings, workdir / "lmcache-server.log") as lmcache:
        lmcache.wait_ready()
        configs = side_configs(alone, cpu_bytes, lmcache, peers_bin / "python", offloading)
        with running_servers(configs, workdir) as servers:
            sessions = {side: [s.proc.pid] for side, s in servers.items()}
            sessions["lmcache"].append(lmcache.proc.pid)  # LMCache's server is its side's
            memory = MemoryPeaks(sessions)
            memory.start()
            warm = unique(words(setup.shape.vocab), 2, 64, 4, seed=99)
            for server in servers.values():
                run_one_by_one(server.url, "model", warm)
            plays: list[Play] = []
            for d in setup.datasets:
                for rate in d.rates:
                    play = _client_play(model, d, rate)
                    plays.append((d.name, d.reuse, rate, d.prompts, play))
            for seed, (name, make) in enumerate(setup.chats.items()):
                workload = make(seed)
                for i, rate in enumerate(setup.chat_rates):
                    plays.append(
                        (name, True, rate, workload.requests, _chat_play(workload, rate, i))
                    )
            plays = [p for p in plays if not rows or p[0] in rows]
            runs = play_grid(Bench(servers, lmcache), plays, repeats)
            out["memory"] = memory.stop()
    reuse = {row: r for row, r, *_ in plays}
    ceilings = saturation_ceilings(runs, [row for row, r in reuse.items() if r])
    return {**out, "runs": runs, "verdicts": summarize(runs, reuse), "ceilings": ceilings}


def _client_play(
    model: Path, d: ClientDataset, rate: float
) -> Callable[[OpenAIServer], ClientFigures]:
    def play(server: OpenAIServer) -> ClientFigures:
        result = play_client(server, model, d, rate)
        errors = [e for e in result.get("errors", []) if e]
        if errors:
            print(f"    {len(errors)} requests failed, first: {errors[0]}", flush=True)
        return ClientFigures.of(result)

    return play


def _chat_play(
    workload: Workload, rate: float, seed: int
) -> Callable[[OpenAIServer], ClientFigures]:
    def play(server: OpenAIServer) -> ClientFigures:
        return chat_figures(run_load(server.url, "model", workload, rate, seed=seed))

    return play


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the tiny model, small workloads")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="plays of the whole grid; the restart row's returns and restarts (>= 2: a spread)",
    )
    parser.add_argument(
        "--peers",
        type=Path,
        default=REPO_ROOT / ".venv-peers",
        help="the environment `make peers` made",
    )
    parser.add_argument(
        "--only",
        choices=("load", "restart"),
        help="one part: the load rows (1, 2, 4, 5) or the restart row (3)",
    )
    parser.add_argument(
        "--lmcache-chunk-size",
        type=int,
        default=BLOCK,
        help="LMCache's chunk (tokens); its docs: the engine's block size",
    )
    parser.add_argument(
        "--lmcache-eviction",
        default="LRU",
        choices=("LRU", "ARC"),
        help="LMCache's L1 eviction policy",
    )
    parser.add_argument(
        "--rows", help="only these load rows, comma-separated (e.g. random,multi_turn)"
    )
    parser.add_argument("--table", type=Path, help="print a result's table, run nothing")
    args = parser.parse_args(argv)
    if args.table is not None:
        try:
            result = json.loads(args.table.read_text())
        except (OSError, ValueError) as error:
            parser.error(f"--table {args.table}: not a result of this benchmark ({error})")
        if not isinstance(result, dict) or not isinstance(result.get("runs"), list):
            parser.error(f"--table {args.table}: not a load result (no runs)")
        print(markdown_table(result))
        return
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    if args.lmcache_chunk_size < BLOCK or args.lmcache_chunk_size % BLOCK:
        parser.error(f"--lmcache-chunk-size {args.lmcache_chunk_size}: a multiple of {BLOCK}")
    peers_bin = args.peers / "bin"
    if not (peers_bin / "lmcache").exists():
        parser.error(f"--peers {args.peers}: no LMCache there; run `make peers` first")
    setup = quick_setup() if args.quick else full_setup()
    known = [d.name for d in setup.datasets] + list(setup.chats)
    rows = [r for r in args.rows.split(",") if r] if args.rows else []
    if any(r not in known for r in rows):
        parser.error(f"--rows {args.rows}: the load rows are {', '.join(known)}")
    shape = asdict(setup.shape) | {"block_size": BLOCK, "pool_blocks": setup.pool_blocks}
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-bench-peers-") as tmp,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        result: dict[str, Any] = {}
        if args.only != "restart":
            result = bench(setup, Path(tmp), peers_bin, args.repeats, args.lmcache_chunk_size,
                           args.lmcache_eviction, rows)  # fmt: skip
        if args.only != "load" and not args.quick:
            restart = restart_row(Path(tmp), peers_bin, returns=args.repeats, restarts=args.repeats)
            result["restart"] = restart
    result |= {"shape": shape, "repeats": args.repeats, "wall_s": time.perf_counter() - started}
    for v in result.get("restart", {}).get("verdicts", []):
        print(
            f"restart row: {v['target']}: kvtier {v['kvtier_s']:.3f} s (spread "
            f"{v['kvtier_spread']:.0%}), LMCache {v['lmcache_s']:.3f} s (spread "
            f"{v['lmcache_spread']:.0%}): x{v['ratio']:.2f} {'met' if v['met'] else 'NOT met'}"
        )
    for c in result.get("ceilings", []):
        print(
            f"{c['row']} all at once: computed prompt tokens {c['computed_tokens']}; "
            f"kvtier at most x{c['ceiling']:.2f} LMCache's requests/s at vLLM alone's rate "
            f"({c['alone_tokens_per_s']:.0f} tokens/s), x{c['achieved']:.2f} achieved"
            + (
                f"; fitted: {c['fit']['fixed_s']:.2f} s fixed + {c['fit']['per_token_ms']:.3f} "
                f"ms a token, kvtier at most x{c['fit']['ceiling']:.2f}"
                if c["fit"]
                else ""
            )
        )
    for row, lines in result.get("verdicts", {}).items():
        for v in lines:
            print(
                f"{row} rate {v['rate']}: {v['target']}: x{v['ratio']:.2f} "
                f"(spread {v['spread']}) {'met' if v['met'] else 'NOT met'}"
            )
    name = ("peers-quick" if args.quick else "peers") + (f"-{args.only}" if args.only else "")
    if rows:  # a part of the grid: its own file
        name += "-" + "-".join(rows)
    if (args.lmcache_chunk_size, args.lmcache_eviction) != (BLOCK, "LRU"):  # a variant's own file
        name += f"-lmcache-{args.lmcache_chunk_size}-{args.lmcache_eviction.lower()}"
    print(write_result(name, result))
    if "runs" in result:
        print(markdown_table(result))


if __name__ == "__main__":
    main()
