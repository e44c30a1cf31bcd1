"""bench_vllm's crossover table (`--shapes crossover`): where loading a returning prompt
from a slow Redis stops beating recomputing it, and whether kvtier's per-request decision
(`load_decision: measured`) lands on the faster side in every cell.

Cells: returning prompts of 256, 1,024 and 4,096 tokens on the 0.5B-shaped model, Redis
at +0, +20 and +200 ms per round trip (the shaping proxy, `kvtier.remote.shaping_proxy`,
in front of a real redis-server). Three sides, each one engine kept up for the whole table
and asked one request at a time (`kvtier.vllm.engines.stepwise`):
- `recompute`: vLLM alone (no connector), which computes every prompt;
- `always`: kvtier with `load_decision: always` (every Redis hit loaded);
- `measured`: kvtier with `load_decision: measured` (the default).

A writer engine first puts every returning prompt in Redis (no proxy), so that both
kvtier sides find each one there and nowhere else (their CPU tier never saw it). Then,
per delay, the proxy is reshaped and every side serves the same warm-up (a cold
512-token prompt of its own, which gives the engine's recompute estimate at this moment,
and two 512-token returning prompts, which move the Redis estimates to the new delay;
smoothing 0.2), then the cells, `REPEATS` prompts per length. The sides alternate order
request by request (A B C, C B A, ...), each request after every engine idled `IDLE_S`. A cell's
figure is each side's median TTFT; its spread (slowest over fastest of the repeats) is
reported beside it. Target (issue 33): `measured` within 1.1x of the better of
`recompute` and `always` in every cell. Writes vllm_crossover.json.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench_redis import redis_server
from benchmarks.bench_vllm import (
    BLOCK,
    QWEN2_05B,
    REDIS_TIMEOUTS,
    SETTLE_S,
    Size,
    _job,
    _once,
    _timed_run,
    kvtier_warnings,
)
from kvtier.remote.shaping_proxy import LinkProfile, ShapingProxy
from kvtier.vllm import transfer_config
from kvtier.vllm.engines import RequestResult, Round, random_prompts, write_model
from kvtier.vllm.engines.stepwise import IDLE_S, StepwiseEngine, interleaved_order

RESULT_NAME = "vllm_crossover"
TOKENS = (256, 1024, 4096)
DELAYS_S = (0.0, 0.020, 0.200)
REPEATS = 2
WARMUP_TOKENS = 512
WARMUP_RETURNS = 2  # returning warm-up prompts per delay, after the cold one
SIDES = ("recompute", "always", "measured")
TARGET_VS_BEST = 1.1
SIZE = Size(max(TOKENS), QWEN2_05B, shape="crossover")  # the pool and model length


@dataclass(frozen=True)
class Request:
    """One request the sides serve: its delay, what it is, and its prompt: one for every
    side, or (a cold prompt) one per side in `SIDES` order, so that no side finds in
    Redis the cold prompt another side computed and stored there."""

    delay_s: float
    kind: str  # "cold", "warm" or "cell"
    tokens: int
    prompts: tuple[tuple[int, ...], ...]

    @property
    def in_redis(self) -> bool:
        return self.kind != "cold"

    def prompt(self, side: str) -> tuple[int, ...]:
        return self.prompts[SIDES.index(side)] if len(self.prompts) > 1 else self.prompts[0]

    @property
    def name(self) -> str:
        return f"{self.delay_s * 1000:g}ms:{self.kind}:{self.tokens}"


def plan(repeats: int = REPEATS) -> list[Request]:
    """Every request in the order served: per delay, the warm-up, then the cells (each
    length in turn, `repeats` times)."""
    lengths = [WARMUP_TOKENS] * (1 + WARMUP_RETURNS) + [t for _ in range(repeats) for t in TOKENS]
    out = []
    for d, delay in enumerate(DELAYS_S):
        kinds = ["cold"] + ["warm"] * WARMUP_RETURNS + ["cell"] * (len(lengths) - 3)
        for i, (kind, tokens) in enumerate(zip(kinds, lengths, strict=True)):
            n = len(SIDES) if kind == "cold" else 1
            prompts = random_prompts(n, tokens, QWEN2_05B.vocab, seed=1000 * (d + 1) + i)
            out.append(Request(delay, kind, tokens, tuple(prompts)))
    return out


def reader_config(redis_url: str, decision: str) -> dict[str, Any]:
    """A kvtier side: a CPU tier (that never holds a returning prompt: each is new to
    it) over the Redis tier behind the proxy, with bench_vllm's Redis timeouts (a late
    answer is late, not a failure)."""
    cpu = 2 * SIZE.kv_bytes
    return transfer_config(
        cpu_bytes_to_use=cpu, redis_url=redis_url, load_decision=decision, **REDIS_TIMEOUTS
    )


def write_prompts(model: Path, requests: list[Request], redis_url: str) -> list[str]:
    """The writer engine: every returning prompt, through to Redis (no proxy); a one-block
    request and a settle at the end, so that the last stores are out. Its warnings."""
    (flush,) = random_prompts(1, BLOCK, QWEN2_05B.vocab, seed=2)
    rounds = [_once(r.prompts[0], r.name) for r in requests if r.in_redis]
    rounds.append(_once(flush, "flush", SETTLE_S))
    config = transfer_config(cpu_bytes_to_use=2 * SIZE.kv_bytes, redis_url=redis_url)
    config["kv_connector_extra_config"] |= {"redis_socket_timeout_s": 60.0}
    run = _timed_run(
        "writer (every returning prompt to Redis)", _job(model, tuple(rounds), config, SIZE)
    )
    return kvtier_warnings(run.log)


@contextmanager
def _sides(
    model: Path, requests: list[Request], proxy_url: str
) -> Iterator[dict[str, StepwiseEngine]]:
    configs = {
        "recompute": None,
        "always": reader_config(proxy_url, "always"),
        "measured": reader_config(proxy_url, "measured"),
    }
    with ExitStack() as stack:
        engines = {}
        for side, config in configs.items():
            rounds = tuple(
                Round((r.prompt(side),), max_tokens=1, logprobs=1, name=r.name) for r in requests
            )
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"xo-{side}-")))
            engines[side] = StepwiseEngine(_job(model, rounds, config, SIZE), tmp, 1800)
            stack.callback(engines[side].close)
        for side, engine in engines.items():
            print(f"   engine: {side}: started in {engine.started():.1f} s", flush=True)
        yield engines


def bench_crossover(workdir: Path, repeats: int = REPEATS) -> dict[str, Any]:
    model = write_model(workdir / "model-crossover", QWEN2_05B, weights=False)
    requests = plan(repeats)
    served: dict[str, list[RequestResult]] = {side: [] for side in SIDES}
    with redis_server() as port:
        target = ("127.0.0.1", port)
        writer_warnings = write_prompts(model, requests, f"redis://{target[0]}:{port}/0")
        with ShapingProxy(target) as proxy, _sides(model, requests, proxy.url) as engines:
            for delay in DELAYS_S:
                proxy.reshape(LinkProfile.round_trip(delay))
                mine = [k for k, r in enumerate(requests) if r.delay_s == delay]
                print(f"   Redis +{delay * 1000:g} ms: {len(mine)} requests per side", flush=True)
                for j, side in interleaved_order(SIDES, len(mine)):
                    time.sleep(IDLE_S)
                    served[side].append(engines[side].request(mine[j], 0))
            warnings = {side: kvtier_warnings(e.log()) for side, e in engines.items()}
    return {**summarize(requests, served), "warnings": {"writer": writer_warnings, **warnings}}


def summarize(requests: list[Request], served: dict[str, list[RequestResult]]) -> dict[str, Any]:
    """Per (delay, length): each side's TTFTs, cached tokens, median and spread; and
    `measured` over the better of the other two."""
    cells: dict[tuple[float, int], dict[str, list[RequestResult]]] = {}
    for k, request in enumerate(requests):
        if request.kind == "cell":
            cell = cells.setdefault((request.delay_s, request.tokens), {s: [] for s in SIDES})
            for side in SIDES:
                cell[side].append(served[side][k])
    rows = []
    for (delay, tokens), sides in cells.items():
        ttft = {side: [r.wall_s for r in rs] for side, rs in sides.items()}
        median = {side: statistics.median(t) for side, t in ttft.items()}
        best = min(median["recompute"], median["always"])
        rows.append(
            {
                "redis_added_ms": delay * 1000,
                "prompt_tokens": tokens,
                "ttft_s": ttft,
                "median_ttft_s": median,
                "spread": {side: max(t) / min(t) for side, t in ttft.items()},
                "cached_tokens": {s: [r.num_cached_tokens for r in rs] for s, rs in sides.items()},
                "measured_vs_best": median["measured"] / best,
                "meets_target": median["measured"] / best <= TARGET_VS_BEST,
            }
        )
    warmups = [
        {"request": r.name, **{side: served[side][k].wall_s for side in SIDES}}
        | {f"{side}_cached": served[side][k].num_cached_tokens for side in SIDES}
        for k, r in enumerate(requests)
        if r.kind != "cell"
    ]
    return {
        "shape": "crossover",
        "model": QWEN2_05B.__dict__,
        "block_size": BLOCK,
        "pool_blocks": SIZE.pool_blocks,
        "sides": list(SIDES),
        "order": "per delay: warm-up, then each length in turn; sides alternate per request",
        "idle_s_before_each_request": IDLE_S,
        "rows": rows,
        "warmup": warmups,
        "meets_target": all(row["meets_target"] for row in rows),
        "target_measured_vs_best": TARGET_VS_BEST,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        "   Redis   tokens  recompute   always  measured  measured/best  (cached: always, measured)"
    )
    for row in result["rows"]:
        m, c = row["median_ttft_s"], row["cached_tokens"]
        print(
            f"   +{row['redis_added_ms']:<5g} {row['prompt_tokens']:6d}  {m['recompute']:8.3f}"
            f"  {m['always']:8.3f}  {m['measured']:8.3f}  {row['measured_vs_best']:8.2f}"
            f"  {'ok' if row['meets_target'] else 'MISS'}  ({c['always']}, {c['measured']})",
            flush=True,
        )


def run(host: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.common import write_result

    print("== crossover: a returning prompt from Redis at +0/+20/+200 ms, load or recompute")
    with tempfile.TemporaryDirectory(prefix="bench-xo-") as tmp:
        result = bench_crossover(Path(tmp))
    print_table(result)
    print(write_result(RESULT_NAME, {**host, **result}))
    return result
