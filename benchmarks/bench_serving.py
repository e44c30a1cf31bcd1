"""vLLM's OpenAI server alone against the same server with kvtier, under load (issue 27).

    .venv/bin/python -m benchmarks.bench_serving [--quick] [--workloads multi_turn,...]
        [--profiles cpu,redis:delay_ms=200,...] [--rates 0.5,1,inf] [--repeats N]

Writes benchmarks/results/serving.json (serving-quick.json with --quick). Two servers,
one per side, started together and kept up for the whole run: vLLM alone, and vLLM with
kvtier's CPU tier (`KvtierConnector`), the same model, pool, flags and CPU binding
(`same_cpus_env`), each warmed up by the same request. Per workload:

1. idle: the workload one request at a time on each side (each sent when the one
   before is answered: no request waits for another); vLLM alone's TTFT p90 there is
   the workload's idle TTFT;
2. open loop at a few rates, from below vLLM alone's one-at-a-time rate to all at once
   (`inf`): Poisson arrivals, streamed chat completions, the sides taking turns (which
   side goes first alternates from rate to rate), `POST /reset_prefix_cache` (kvtier's
   tiers too) before every run, so each starts cold.

Per side, workload and rate: requests/s and output tokens/s over the run's span, TTFT
p50/p90/p99, inter-token latency p50/p90, prompt and cached prompt tokens (the usage's
`prompt_tokens_details`), and kvtier's per-tier lookups, hits, loads and stores (the
difference of two /metrics scrapes). The verdicts are the issue's, at the reference
rate: the highest rate at which vLLM alone keeps its TTFT p90 within twice its idle
TTFT p90. At a rate both sides keep up with, both serve that rate, so the throughput verdict
is also given as capacity (the highest rate a side serves within that same TTFT bound)
and as throughput at saturation (`inf`).

Model: a Llama-shaped 8-layer model (hidden 512, 8 heads, 2 KV heads, MLP 1536, vocab
8192), dummy weights, float32, 32-token blocks, a pool of 128 blocks (4,096 tokens);
prompts of 500-1,600 tokens, 16 answer tokens: on vLLM's CPU build a 1,500-token
prefill takes about a second and a decode step about 15 ms, so prefill dominates.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import redis

from benchmarks.bench_redis import redis_server
from benchmarks.common import write_result
from benchmarks.peer_figures import Comparison, paired
from benchmarks.serving_profiles import (
    DEFAULT_RIG,
    REDIS_SOCKET_TIMEOUT_S,
    SMALL_CPU_POOLS,
    Rig,
    TierProfile,
    parse_profile,
    parse_profiles,
)
from kvtier.remote.proxy_process import ProxyProcess, check_nice
from kvtier.vllm import transfer_config
from kvtier.vllm.engines import TINY, ModelShape, write_model
from kvtier.vllm.engines.chat_workloads import Workload, documents, multi_turn, unique
from kvtier.vllm.engines.load_client import (
    Answer,
    BeforeSend,
    LoadSummary,
    percentile,
    run_load,
    run_one_by_one,
)
from kvtier.vllm.engines.openai_server import (
    OpenAIServer,
    ServerConfig,
    kvtier_counters,
    running_servers,
)
from kvtier.vllm.engines.sessions import compute_cores, move_processes
from kvtier.vllm.engines.tokenizer import words, write_tokenizer

SERVING = ModelShape(
    "llama", layers=8, hidden=512, heads=8, kv_heads=2, intermediate=1536, vocab=8192
)
BLOCK = 32
SIDES = ("vllm", "kvtier")
# the targets: (workload kinds, kvtier/vLLM throughput at least, TTFT p90 at most)
REUSE_TARGET = (1.5, 0.5)
NO_REUSE_TARGET = (0.97, 1.05)
IDLE_BOUND = 2.0  # the reference rate keeps vLLM alone's TTFT p90 within this x idle


@dataclass(frozen=True)
class Setup:
    shape: ModelShape
    pool_blocks: int
    workloads: dict[str, Callable[[int], Workload]]  # by name: seed -> workload
    rate_fractions: tuple[float, ...]  # of vLLM alone's one-at-a-time rate; inf: all at once
    max_model_len: int


def full_setup() -> Setup:
    vocabulary = words(SERVING.vocab)
    return Setup(
        SERVING,
        pool_blocks=128,
        workloads={
            # 12 conversations x 3 turns of 512 words: 12 x ~1,600 tokens at the end,
            # 4.7x the pool
            "multi_turn": lambda seed: multi_turn(vocabulary, 12, 3, 512, 16, seed),
            # 4 documents of 1,792 words (1.75x the pool), 16 questions each: a document's
            # first question is one request in 16, not the TTFT p90's one in 10
            "documents": lambda seed: documents(vocabulary, 4, 1792, 16, 32, 16, seed),
            "unique": lambda seed: unique(vocabulary, 24, 1024, 16, seed),
        },
        rate_fractions=(0.5, 1.0, 2.0, math.inf),
        max_model_len=2048,
    )


def quick_setup() -> Setup:
    vocabulary = words(TINY.vocab)
    return Setup(
        TINY,
        pool_blocks=24,
        workloads={
            "multi_turn": lambda seed: multi_turn(vocabulary, 4, 2, 200, 8, seed),
            "documents": lambda seed: documents(vocabulary, 3, 300, 3, 16, 8, seed),
            "unique": lambda seed: unique(vocabulary, 8, 200, 8, seed),
        },
        rate_fractions=(1.0, math.inf),
        max_model_len=512,
    )


def _nothing() -> None:
    return None


def by_turn(answers: list[Answer]) -> dict[str, dict[str, float]]:
    """TTFT of conversations' first turns (nothing of theirs to reuse) and of the later
    ones (a history to load or recompute), apart, and of each later turn (`turn_2`...:
    the shortest histories save the least): a side that wins the later turns and loses
    the first shows it (the percentiles over all requests mix the two)."""
    ok = [a for a in answers if a.ok]
    groups = [("first", [a for a in ok if a.turn == 0]), ("later", [a for a in ok if a.turn > 0])]
    later_turns = sorted({a.turn for a in ok if a.turn > 0})
    if len(later_turns) > 1:  # and each later turn apart: a history of one turn, of two...
        groups += [(f"turn_{t + 1}", [a for a in ok if a.turn == t]) for t in later_turns]
    out: dict[str, dict[str, float]] = {}
    for name, group in groups:
        if group:
            ttft = [a.ttft_s for a in group]
            out[name] = {
                "requests": len(group),
                "ttft_p50_s": percentile(ttft, 50),
                "ttft_mean_s": sum(ttft) / len(ttft),
                "cached_tokens": sum(a.cached_tokens for a in group),
            }
    return out


def _run_side(
    server: OpenAIServer, play: Callable[[], list[Any]], after_run: Callable[[], None] = _nothing
) -> tuple[LoadSummary, dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """One side's run: its summary, what its tiers did (`/metrics`), its TTFT by turn."""
    server.reset()
    before = kvtier_counters(server.get("/metrics"))
    try:
        answers = play()
    finally:
        after_run()  # a profile's stalled link flows again
    # vLLM's stats reach the frontend asynchronously: let one more interval pass
    time.sleep(1.5)
    after = kvtier_counters(server.get("/metrics"))
    # counters as what the run added; the cost model's estimates as they stood at its end
    tiers = {
        tier: {
            name: value if name.startswith("cost_") else value - before.get(tier, {}).get(name, 0.0)
            for name, value in figures.items()
            if not name.startswith(("capacity", "used", "breaker", "lookup_seconds"))
        }
        for tier, figures in after.items()
    }  # fmt: skip
    failed = [a.error for a in answers if not a.ok]
    if failed:
        raise RuntimeError(
            f"{server.url}: {len(failed)} requests failed, first: {failed[0]}; the "
            f"server's log ends:\n{server.log_tail()}"
        )
    return LoadSummary.of(answers), tiers, by_turn(answers)


def bench(
    setup: Setup,
    workdir: Path,
    only: list[str],
    profiles: list[TierProfile] | None = None,
    repeats: int = 1,
    rig: Rig = DEFAULT_RIG,
) -> dict[str, Any]:
    """Every workload under every profile (default: kvtier's CPU tier alone), each beside
    vLLM alone, `repeats` times (see `_workload`). Results by workload, then by profile
    where more than the default ran. `rig`: how the redis-server and the shaping proxy
    (each a process of its own), which stand in for a remote Redis, share the cores."""
    profiles = profiles or [parse_profile("cpu")]
    model = write_model(workdir / "model", setup.shape, weights=False)
    write_tokenizer(model, setup.shape.vocab)
    block_bytes = setup.shape.kv_bytes(BLOCK)
    alone = ServerConfig(
        model, BLOCK, pool_blocks=setup.pool_blocks, max_model_len=setup.max_model_len
    )
    with ExitStack() as stack:
        proxy = None
        configs = {"vllm": alone}
        if any(not p.redis and not p.control for p in profiles):
            kvtier = transfer_config(cpu_bytes_to_use=32 * setup.pool_blocks * block_bytes)
            configs["kvtier"] = replace(alone, kv_transfer_config=kvtier)
        if any(p.control for p in profiles):
            configs["vllm_control"] = alone
        if any(p.redis for p in profiles):
            port = stack.enter_context(redis_server(rig.nice))
            proxy = stack.enter_context(ProxyProcess(("127.0.0.1", port), nice=rig.nice))
            cpu = SMALL_CPU_POOLS * setup.pool_blocks * block_bytes
            kvtier = transfer_config(
                cpu_bytes_to_use=cpu,
                redis_url=proxy.url,
                redis_socket_timeout_s=REDIS_SOCKET_TIMEOUT_S,
            )
            configs["kvtier_redis"] = replace(alone, kv_transfer_config=kvtier)
        for profile in (p for p in profiles if p.disk):
            # the whole workload fits on disk (file headers are bytes a block)
            kvtier = transfer_config(
                cpu_bytes_to_use=SMALL_CPU_POOLS * setup.pool_blocks * block_bytes,
                disk_path=str(workdir / profile.server / "disk"),
                disk_bytes_to_use=40 * setup.pool_blocks * block_bytes,
                disk_writes="demote" if profile.demote else "write_through",
            )
            configs[profile.server] = replace(alone, kv_transfer_config=kvtier, env=profile.env)
        started = time.perf_counter()
        servers = stack.enter_context(running_servers(configs, workdir))
        out: dict[str, Any] = {"servers_start_s": time.perf_counter() - started, "workloads": {}}
        if proxy is not None:
            out["rig"] = {**asdict(rig), "cores": _place_rig(rig, servers, proxy, port)}
        warm = unique(words(setup.shape.vocab), 2, 64, 4, seed=99)
        for server in servers.values():
            run_one_by_one(server.url, "model", warm)
        for w, name in enumerate(only):
            make = setup.workloads[name]
            by_profile = {}
            for profile in profiles:
                if proxy is not None:
                    proxy.reshape(profile.link)
                sides = {"vllm": servers["vllm"], "kvtier": servers[profile.server]}
                hook = profile.stall_hook(proxy)
                rig_cpu = None
                if proxy is not None and profile.redis:
                    rig_cpu = partial(_rig_cpu, proxy, port)
                result = _workload(
                    setup,
                    sides,
                    make,
                    seed=w,
                    before=hook,
                    after_run=_resume(proxy),
                    rig_cpu=rig_cpu,
                    repeats=repeats,
                )
                by_profile[profile.name] = {**result, "profile": asdict(profile)}
                print(f"{name} [{profile.name}]: {verdict_line(result)}", flush=True)
                if repeats > 1:
                    for line in comparison_lines(result):
                        print(f"   {line}", flush=True)
            default = len(profiles) == 1 and profiles[0].name == "cpu"
            out["workloads"][name] = by_profile[profiles[0].name] if default else by_profile
    return out


def _place_rig(
    rig: Rig, servers: dict[str, OpenAIServer], proxy: ProxyProcess, redis_port: int
) -> list[int] | None:
    """With `rig.apart`, move the redis-server and the proxy off the cores the engines'
    workers compute on; the cores they run on (None: any)."""
    computing = compute_cores(server.proc.pid for server in servers.values())
    rest = set(range(os.cpu_count() or 1)) - computing
    if not rig.apart or not computing or not rest:
        return None
    redis_pid = int(_redis_info(redis_port, "server")["process_id"])
    move_processes([redis_pid, proxy.pid], rest)
    return sorted(rest)


def by_thread(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The CPU seconds each of a server's threads (by process title and thread name)
    took between two readings, those of 0.05 s or more, the most first: what a side's
    extra CPU went to (kvtier's threads are named, `kvtier.thread_names`)."""
    used = {key: after[key] - before.get(key, 0.0) for key in after}
    return {key: round(v, 3) for key, v in sorted(used.items(), key=lambda kv: -kv[1]) if v >= 0.05}


def _rig_cpu(proxy: ProxyProcess, redis_port: int) -> dict[str, float]:
    """CPU seconds so far of the shaping proxy's process and of the redis-server (its
    INFO cpu: user and system, every thread of it)."""
    cpu = _redis_info(redis_port, "cpu")
    server = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return {"proxy": proxy.cpu_seconds, "redis_server": server}


def _redis_info(port: int, section: str) -> dict[str, Any]:
    """One section of the rig's redis-server's INFO."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
    try:
        info: dict[str, Any] = client.info(section)
    finally:
        client.close()
    return info


def _resume(proxy: ProxyProcess | None) -> Callable[[], None]:
    return _nothing if proxy is None else proxy.resume


def _workload(
    setup: Setup,
    servers: dict[str, OpenAIServer],
    make: Callable[[int], Workload],
    seed: int,
    before: BeforeSend | None = None,
    after_run: Callable[[], None] = _nothing,
    rig_cpu: Callable[[], dict[str, float]] | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """One workload on both sides; `before`, `after_run`: the kvtier side's profile
    (a stall before a request, the link flowing again after the run); `rig_cpu`: the
    CPU seconds so far of what stands in for a remote Redis here (the shaping proxy,
    the redis-server), which run on the engines' cores where a real deployment's would
    not: each kvtier run reports what they took (`rig_cpu_s`). `repeats`: the whole
    (one at a time, then each rate) played that many times, the side going first
    alternating from run to run and from repeat to repeat; `idle` and `runs` are the
    first repeat's, `repeats` the others', `comparisons` and `verdict` over all."""
    workload = make(seed)
    hooks = {"vllm": (None, _nothing), "kvtier": (before, after_run)}
    played: list[dict[str, Any]] = []  # per repeat: {"idle": ..., "runs": ...}
    rates: list[float] = []
    for r in range(repeats):
        idle: dict[str, Any] = {}
        for side in SIDES if (seed + r) % 2 == 0 else SIDES[::-1]:
            server, (hook, after) = servers[side], hooks[side]
            play = partial(run_one_by_one, server.url, "model", workload, before=hook)
            summary, tiers, turns = _run_side(server, play, after)
            idle[side] = {**asdict(summary), "tiers": tiers, "by_turn": turns}
        if not rates:  # vLLM alone's first one-at-a-time rate: one over its time a request
            per_request_s = idle["vllm"]["span_s"] / idle["vllm"]["requests"]
            rates = [f / per_request_s for f in setup.rate_fractions]
        runs: list[dict[str, Any]] = []
        for i, rate in enumerate(rates):
            # JSON has no infinity: all at once is a rate of null
            row: dict[str, Any] = {"rate": rate if math.isfinite(rate) else None}
            for side in SIDES if (i + r) % 2 == 0 else SIDES[::-1]:
                server, (hook, after) = servers[side], hooks[side]
                play = partial(run_load, server.url, "model", workload, rate, seed=i, before=hook)
                cpu_before = rig_cpu() if rig_cpu is not None and side == "kvtier" else None
                server_before, threads_before = server.cpu_seconds(), server.thread_cpu_seconds()
                summary, tiers, turns = _run_side(server, play, after)
                server_cpu = server.cpu_seconds() - server_before
                row[side] = {**asdict(summary), "tiers": tiers, "by_turn": turns}
                row[side]["server_cpu_s"] = server_cpu
                row[side]["server_cpu_by_thread"] = by_thread(
                    threads_before, server.thread_cpu_seconds()
                )
                rig = f", server CPU s {server_cpu:.2f}"
                if rig_cpu is not None and cpu_before is not None:
                    used = {k: v - cpu_before[k] for k, v in rig_cpu().items()}
                    row[side]["rig_cpu_s"] = used
                    rig += ", of " + ", ".join(f"the {k} {v:.2f}" for k, v in used.items())
                top = list(row[side]["server_cpu_by_thread"].items())[:5]
                rig += "; by thread " + ", ".join(f"{k} {v:.2f}" for k, v in top)
                brief = _brief(summary)
                print(f"   {workload.name} rate {rate:.3f}/s {side}: {brief}{rig}", flush=True)
            runs.append(row)
        played.append({"idle": idle, "runs": runs})
    idle, runs = played[0]["idle"], played[0]["runs"]
    idle_ttft = statistics.median(p["idle"]["vllm"]["ttft_p90_s"] for p in played)
    return {
        "requests": workload.requests,
        "idle": idle,
        "idle_ttft_p90_s": {side: idle[side]["ttft_p90_s"] for side in SIDES},
        "runs": runs,
        "repeats": played[1:],
        "comparisons": comparisons(played),
        "verdict": verdicts(workload.name, median_runs(played), idle_ttft),
    }


# the figures compared over repeats: kvtier's median over vLLM alone's, with the spread
COMPARED = ("requests_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s")


def _phases(played: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, that phase's result in each repeat): "idle", then each run by its rate
    (vLLM alone's rate in the first repeat; the same in every repeat)."""
    phases = [("idle", [p["idle"] for p in played])]
    for i, run in enumerate(played[0]["runs"]):
        label = "inf" if run["rate"] is None else f"{run['rate']:.3f}"
        phases.append((label, [p["runs"][i] for p in played]))
    return phases


def comparisons(played: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per phase and figure (COMPARED): kvtier's median over the repeats against vLLM
    alone's, the larger of the two sides' spreads, and whether the gap is larger than
    the spread (`peer_figures.Comparison`; one repeat has no spread, so nothing it
    shows is decisive); and each repeat's own ratio (`peer_figures.paired`)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for label, got in _phases(played):
        out[label] = {}
        for figure in COMPARED:
            ours, theirs = [g["kvtier"][figure] for g in got], [g["vllm"][figure] for g in got]
            out[label][figure] = asdict(Comparison.of(ours, theirs)) | paired(ours, theirs)
    return out


def median_runs(played: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs at each rate with each side's figures (COMPARED) the medians over the
    repeats: what the verdicts judge."""
    out = []
    for _, got in _phases(played)[1:]:
        row: dict[str, Any] = {"rate": got[0]["rate"]}
        for side in SIDES:
            row[side] = {f: statistics.median(g[side][f] for g in got) for f in COMPARED}
        out.append(row)
    return out


def _brief(s: LoadSummary) -> str:
    return (
        f"{s.requests_per_s:.3f} req/s, {s.output_tokens_per_s:.1f} tok/s, TTFT p50/p90 "
        f"{s.ttft_p50_s:.2f}/{s.ttft_p90_s:.2f} s, cached {s.cached_tokens}/{s.prompt_tokens}"
    )


def verdicts(workload: str, runs: list[dict[str, Any]], idle_ttft_s: float) -> dict[str, Any]:
    """The issue's targets at the reference rate. Where both sides keep up with that
    rate both serve it, so the throughput target is also judged where it can show: at
    saturation (all requests at once), and as capacity (the highest rate a side serves
    within the TTFT bound)."""
    bound = IDLE_BOUND * idle_ttft_s
    within = [r for r in runs if r["vllm"]["ttft_p90_s"] <= bound]
    reference = within[-1] if within else runs[0]  # runs go up in rate
    least_throughput, most_ttft = NO_REUSE_TARGET if workload == "unique" else REUSE_TARGET

    def ratio(run: dict[str, Any], figure: str) -> float:
        return float(run["kvtier"][figure] / run["vllm"][figure])

    def throughput_met(value: float) -> bool:
        if workload == "unique":  # within 3% either way
            return abs(value - 1) <= 1 - least_throughput
        return value >= least_throughput

    def capacity(side: str) -> float | None:
        ok = [r["rate"] for r in runs if r[side]["ttft_p90_s"] <= bound]
        return ok[-1] if ok else 0.0

    throughput = ratio(reference, "requests_per_s")
    saturation = ratio(runs[-1], "requests_per_s")
    ttft = ratio(reference, "ttft_p90_s")
    return {
        "ttft_bound_s": bound,
        "reference_rate": reference["rate"],
        "reference_rate_within_bound": bool(within),
        "throughput_ratio": throughput,
        "throughput_target": least_throughput,
        "throughput_met": throughput_met(throughput),
        "saturation_throughput_ratio": saturation,
        "saturation_throughput_met": throughput_met(saturation),
        "ttft_p90_ratio": ttft,
        "ttft_p90_target": most_ttft,
        "ttft_p90_met": ttft <= most_ttft,
        "capacity_rate": {side: capacity(side) for side in SIDES},
    }


def verdict_line(result: dict[str, Any]) -> str:
    v = result["verdict"]
    return (
        f"at {v['reference_rate'] or math.inf:.3f} req/s throughput x{v['throughput_ratio']:.2f} "
        f"({'met' if v['throughput_met'] else 'missed'}), TTFT p90 x{v['ttft_p90_ratio']:.2f} "
        f"({'met' if v['ttft_p90_met'] else 'missed'}); at saturation throughput "
        f"x{v['saturation_throughput_ratio']:.2f} "
        f"({'met' if v['saturation_throughput_met'] else 'missed'})"
    )


def comparison_lines(result: dict[str, Any]) -> list[str]:
    """One line per phase: each figure's ratio over the repeats, with its spread."""
    lines = []
    for phase, figures in result["comparisons"].items():
        parts = []
        for figure, c in figures.items():
            spread = "-" if c["spread"] is None else f"{c['spread']:.0%}"
            mark = "" if c["decisive"] else "~"
            paired = "/".join(f"{r:.2f}" for r in c["per_repeat"])
            parts.append(
                f"{figure.removesuffix('_s')} {mark}x{c['ratio']:.2f} ({spread}; {paired})"
            )
        lines.append(f"{phase}: " + ", ".join(parts))
    return lines


def parse_rig_nice(text: str) -> int:
    """`--rig-nice`: a niceness a process may take, 0 to 19."""
    try:
        return check_nice(int(text))
    except ValueError:
        raise ValueError(f"--rig-nice {text!r}; a whole number from 0 to 19") from None


def parse_repeats(text: str) -> int:
    """`--repeats`: a whole number >= 1."""
    try:
        repeats = int(text)
    except ValueError:
        repeats = 0
    if repeats < 1:
        raise ValueError(f"--repeats {text!r}; a whole number >= 1")
    return repeats


def parse_rates(text: str) -> tuple[float, ...]:
    """`--rates`: fractions of vLLM alone's one-at-a-time rate, increasing."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            rate = math.nan
        if not rate > 0:  # nan and negatives too
            raise ValueError(f"--rates {part!r}; a number > 0 or inf")
        rates.append(rate)
    if rates != sorted(set(rates)):
        raise ValueError(f"--rates {text!r}; increasing, each once")
    return tuple(rates)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the tiny model, small workloads")
    parser.add_argument("--workloads", default="multi_turn,documents,unique")
    parser.add_argument(
        "--profiles",
        default="cpu",
        help="tier profiles, comma list (benchmarks/serving_profiles.py): cpu, alone, redis, "
        "redis:delay_ms=N, redis:rate_mb_s=N, redis:stall_after=N, disk, disk:read_ms=N, "
        "disk:write_ms=N (fields combine)",
    )
    parser.add_argument(
        "--rates",
        default=None,
        help="rates as fractions of vLLM alone's one-at-a-time rate, comma list of "
        "numbers > 0 or inf (default: the setup's)",
    )
    parser.add_argument(
        "--repeats",
        default="1",
        help="play each workload (one at a time and every rate) this many times, the "
        "side going first alternating; ratios are medians, with the spread (default 1)",
    )
    parser.add_argument(
        "--rig-nice",
        default="0",
        help="niceness (0-19) of the redis-server and the shaping proxy, which stand in "
        "for a remote Redis on the engines' machine (default 0); at 19 a saturated "
        "engine starves them (a Redis starved by its machine: stores time out)",
    )
    parser.add_argument(
        "--rig-cores",
        choices=("apart", "any"),
        default="apart",
        help="apart (the default): the redis-server and the proxy run off the cores the "
        "engines' workers compute on, as a Redis on another machine takes none of the "
        "model's compute; any: wherever the OS puts them (the figures before 2026-11-29)",
    )
    args = parser.parse_args(argv)
    setup = quick_setup() if args.quick else full_setup()
    try:
        rig = Rig(parse_rig_nice(args.rig_nice), args.rig_cores == "apart")
        repeats = parse_repeats(args.repeats)
        profiles = parse_profiles(args.profiles)
        if args.rates is not None:
            setup = replace(setup, rate_fractions=parse_rates(args.rates))
    except ValueError as e:
        parser.error(str(e))
    only = args.workloads.split(",")
    unknown = sorted(set(only) - set(setup.workloads))
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; known: {sorted(setup.workloads)}")
    host = {"host": socket.gethostname(), "cpus": os.cpu_count(), "quick": args.quick}
    shape = asdict(setup.shape) | {"block_size": BLOCK, "pool_blocks": setup.pool_blocks}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serving-") as tmp, \
            warnings.catch_warnings():  # fmt: skip
        warnings.simplefilter("ignore")
        result = bench(setup, Path(tmp), only, profiles, repeats, rig)
    name = "serving-quick" if args.quick else "serving"
    if [p.name for p in profiles] != ["cpu"]:
        name += "-profiles"
    print(write_result(name, {**host, "shape": shape, **result}))


if __name__ == "__main__":
    main()
