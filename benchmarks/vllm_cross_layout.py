"""bench_vllm's cross-layout Redis row (`--shapes cross`): a returning prompt that an
engine of one tensor-parallel size wrote to Redis, read by an engine of another size.

Two writers of the 0.5B-shaped model, one worker and two, each compute four prompts
(P0..P3 at one worker; Q0..Q3 at two) and write them through to one Redis server
(blocks kept by KV head, `kvtier.remote.head_keys`); each prompt is followed by a
one-block request and a settle, so that its store goes out alone, and the writers'
Redis calls may take 60 s: a two-worker writer's 128-block Redis stores fail at times
on this machine within bench_vllm's 5 s (README, its tensor-parallel row), which would
make the readers miss for a reason that is not the layout. Then a reader of each size,
its only tier below CPU that Redis, serves the eight in the order P0 Q0 Q1 P1 P2 Q2 Q3 P3:
its own layout's prompts and the other's alternate (ABBA), so that neither side always
goes first, and both sides are timed in the same engine (medians compared; `--cross-prompts`
sets how many prompts each writer computes, default 4). Each reader's Redis jobs are
logged (`KVTIER_TRANSFER_LOG`: each worker's seconds per job) into the result, so a slow
load can be told from a slow engine. Targets (issue 37): a cross-layout hit caches as
many tokens as a same-layout one, and its TTFT is within 1.2x of it. Writes
vllm_cross[_<tokens>].json.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.bench_redis import redis_server
from benchmarks.bench_vllm import (
    BLOCK,
    FULL_TOKENS,
    QWEN2_05B,
    SETTLE_S,
    Size,
    _job,
    _once,
    _timed_run,
    kvtier_config,
    kvtier_warnings,
)
from kvtier.vllm.engines import JobResult, random_prompts, write_model

TARGET_VS_SAME_LAYOUT = 1.2
WORKERS = (1, 2)
PER_WRITER = 4  # prompts each writer computes
WRITER_TIMEOUTS = {"redis_socket_timeout_s": 60.0}  # see the module docstring


def result_name(tokens: int) -> str:
    return "vllm_cross" if tokens == FULL_TOKENS else f"vllm_cross_{tokens}"


def bench_cross_layout(
    workdir: Path, tokens: int = FULL_TOKENS, per_writer: int = PER_WRITER
) -> dict[str, Any]:
    sizes = {w: Size(tokens, QWEN2_05B, w, shape="cross") for w in WORKERS}
    model = write_model(workdir / "model-cross", QWEN2_05B, weights=False)
    prompts = random_prompts(2 * per_writer, tokens, QWEN2_05B.vocab, seed=5)
    flushes = random_prompts(per_writer, BLOCK, QWEN2_05B.vocab, seed=6)
    written = {1: prompts[:per_writer], 2: prompts[per_writer:]}  # P0..P3, Q0..Q3
    order = [  # (writer's workers, prompt): P0 Q0 Q1 P1 P2 Q2 Q3 P3
        pair
        for k in range(per_writer)
        for pair in ((1, written[1][k]), (2, written[2][k]))[:: 1 if k % 2 == 0 else -1]
    ]
    readers: dict[int, JobResult] = {}
    transfers: dict[str, list[Any]] = {}
    writers: dict[str, list[str]] = {}
    with redis_server() as port:
        url = f"redis://127.0.0.1:{port}/0"
        for w, mine in written.items():
            rounds = tuple(
                one
                for i, (p, flush) in enumerate(zip(mine, flushes, strict=True))
                for one in (_once(p, f"write{i}"), _once(flush, f"flush{i}", SETTLE_S))
            )
            config = kvtier_config("redis", workdir, url, sizes[w])
            config["kv_connector_extra_config"] |= WRITER_TIMEOUTS
            run = _timed_run(f"writer, {w} worker(s)", _job(model, rounds, config, sizes[w]))
            writers[f"tp{w}"] = kvtier_warnings(run.log)
        for w in WORKERS:
            rounds = tuple(
                _once(p, f"{i}:{'same' if by == w else 'cross'}", SETTLE_S)
                for i, (by, p) in enumerate(order)
            )
            config = kvtier_config("redis", workdir, url, sizes[w])
            log = workdir / f"reader{w}-transfers.jsonl"
            job = _job(model, rounds, config, sizes[w], transfer_log=log)
            readers[w] = _timed_run(f"reader, {w} worker(s)", job)
            lines = log.read_text().splitlines() if log.exists() else []
            transfers[f"read_at_tp{w}"] = [
                row for row in map(json.loads, lines) if row["tier"] == "remote"
            ]
    return {
        **summarize(readers, tokens),
        "per_writer": per_writer,
        "reader_redis_jobs": transfers,
        "writer_warnings": writers,
    }


def summarize(readers: dict[int, JobResult], tokens: int) -> dict[str, Any]:
    rows = {}
    for w, run in readers.items():
        sides: dict[str, list[Any]] = {"same": [], "cross": []}
        for name, (request,) in zip(run.round_names, run.rounds, strict=True):
            sides[name.split(":")[1]].append(request)
        ttft = {side: [r.wall_s for r in rs] for side, rs in sides.items()}
        cached = {side: [r.num_cached_tokens for r in rs] for side, rs in sides.items()}
        ratio = statistics.median(ttft["cross"]) / statistics.median(ttft["same"])
        rows[f"read_at_tp{w}"] = {
            "reader_workers": w,
            "writer_workers": {"same": w, "cross": next(x for x in WORKERS if x != w)},
            "ttft_s": ttft,
            "cached_tokens": cached,
            "median_ttft_s": {side: statistics.median(t) for side, t in ttft.items()},
            "cross_vs_same_ttft": ratio,
            "meets_targets": (
                sorted(cached["cross"]) == sorted(cached["same"])
                and min(cached["same"]) > 0
                and ratio <= TARGET_VS_SAME_LAYOUT
            ),
        }
    return {
        "shape": "cross",
        "model": QWEN2_05B.__dict__,
        "prompt_tokens": tokens,
        "block_size": BLOCK,
        "order": "P0 Q0 Q1 P1 P2 Q2 Q3 P3 ... (P: written at one worker, Q: at two)",
        "rows": rows,
        "targets": {"cached_tokens": "cross == same", "max_cross_vs_same": TARGET_VS_SAME_LAYOUT},
    }
