"""vLLM's KV events from its own engine (no connector), read off ZMQ as a consumer would.

The pool's blocks come with medium "GPU" (vLLM's name for the engine's pool, on the CPU
platform too); offloading tiers add their own media. These pin the subscriber and the
event stream's shape on the overflow workload.
"""

from __future__ import annotations

from tests.vllm.conftest import EngineRun
from tests.vllm.engine_workloads import BLOCK, CACHEABLE_TOKENS, POOL_BLOCKS


def test_stored_blocks_carry_the_prompt_tokens_and_the_pool_medium(
    baseline_run: EngineRun,
) -> None:
    stored = [e for e in baseline_run.events if e.kind == "BlockStored"]
    assert stored, "no BlockStored event arrived"
    assert {e.medium for e in stored} == {"GPU"}
    # the first prompt's full blocks, as the first chain stored
    first = baseline_run.result.round("first")
    assert first  # the job served it
    roots = [e for e in stored if e.parent_block_hash is None]
    assert len(roots[0].token_ids) == len(roots[0].block_hashes) * BLOCK
    assert len(roots[0].token_ids) >= BLOCK


def test_evicted_blocks_are_removed_then_stored_again_on_return(baseline_run: EngineRun) -> None:
    events = baseline_run.events
    removed = [h for e in events if e.kind == "BlockRemoved" for h in e.block_hashes]
    assert {e.medium for e in events if e.kind == "BlockRemoved"} == {"GPU"}
    assert len(removed) >= CACHEABLE_TOKENS // BLOCK
    # the first prompt's blocks: the first stored chain
    first_chain = next(e for e in events if e.kind == "BlockStored")
    first_hashes = set(first_chain.block_hashes)
    assert first_hashes <= set(removed)  # the fillers evicted them all
    stored_again = [
        e for e in events if e.kind == "BlockStored" and first_hashes & set(e.block_hashes)
    ]
    assert len(stored_again) >= 2  # first run, then the recompute on return
    # the pool never holds more distinct blocks than it has
    live: set[object] = set()
    for event in events:
        if event.kind == "BlockStored":
            live |= set(event.block_hashes)
        elif event.kind == "BlockRemoved":
            live -= set(event.block_hashes)
        assert len(live) <= POOL_BLOCKS - 1
