"""kvtier's CPU tier inside a real vLLM engine, against vLLM's own engine on the same job.

The returning prompt was evicted from the engine's pool by the fillers (the baseline
run recomputes all of it); with kvtier it comes back from the CPU tier, and must give
what the engine's own prefix cache gave: the same tokens and logprobs.
"""

from __future__ import annotations

from tests.vllm.conftest import EngineRun
from tests.vllm.engine_workloads import CACHEABLE_TOKENS, FIRST, POOL_HIT, RETURN
from tests.vllm.test_engine_baseline import assert_same_output


def test_returning_prompt_is_served_from_kvtier_with_the_pool_hits_output(
    kvtier_cpu_run: EngineRun, baseline_run: EngineRun
) -> None:
    (returned,) = kvtier_cpu_run.result.round(RETURN)
    (recomputed,) = baseline_run.result.round(RETURN)
    assert recomputed.num_cached_tokens == 0  # nothing of it left in the pool
    assert returned.num_cached_tokens == CACHEABLE_TOKENS  # all of it from kvtier
    (pool_hit,) = baseline_run.result.round(POOL_HIT)
    assert_same_output(returned, pool_hit)  # same tokens and logprobs as a pool hit
    assert returned.token_ids == recomputed.token_ids  # and as a full recompute


def test_kvtier_changes_nothing_else(kvtier_cpu_run: EngineRun, baseline_run: EngineRun) -> None:
    """Every other request of the job: the same output, the same pool hits."""
    for name in (FIRST, POOL_HIT):
        for got, want in zip(
            kvtier_cpu_run.result.round(name), baseline_run.result.round(name), strict=True
        ):
            assert got.num_cached_tokens == want.num_cached_tokens
            assert_same_output(got, want)


def test_kv_events_report_the_cpu_tier(kvtier_cpu_run: EngineRun) -> None:
    """vLLM's publisher carries kvtier's stores with medium CPU beside the pool's GPU."""
    media = {e.medium for e in kvtier_cpu_run.events if e.kind == "BlockStored"}
    assert {"GPU", "CPU"} <= media
    pool_blocks = {
        h
        for e in kvtier_cpu_run.events
        if e.kind == "BlockStored" and e.medium == "GPU"
        for h in e.block_hashes
    }
    cpu_blocks = {
        h
        for e in kvtier_cpu_run.events
        if e.kind == "BlockStored" and e.medium == "CPU"
        for h in e.block_hashes
    }
    # what kvtier stored are the pool's blocks (the same hashes, the same chain)
    assert cpu_blocks and cpu_blocks <= pool_blocks
