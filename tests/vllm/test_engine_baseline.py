"""vLLM's own engine, no connector: the reference every offloading run is compared with.

These pin what the harness shows before kvtier is plugged in: the workload really
overflows the pool (the returning prompt is recomputed), the engine's prefix cache
serves a repeat with the same tokens and logprobs, and the tiny model's output depends
on the whole prompt (a wrong KV block would change it, so equality means something).
"""

from __future__ import annotations

import math

from kvtier.vllm.engines import RequestResult
from tests.vllm.conftest import EngineRun
from tests.vllm.engine_workloads import CACHEABLE_TOKENS, FILLER, FIRST, POOL_HIT, RETURN


def assert_same_output(got: RequestResult, want: RequestResult, tol: float = 1e-4) -> None:
    """Same greedy tokens, and the same logprobs for every top token at every position."""
    assert got.token_ids == want.token_ids
    assert len(got.logprobs) == len(want.logprobs)
    for position, (g, w) in enumerate(zip(got.logprobs, want.logprobs, strict=True)):
        assert g.keys() == w.keys(), f"position {position}: top tokens {g} vs {w}"
        for token, logprob in w.items():
            assert math.isclose(g[token], logprob, abs_tol=tol), (position, token, g, w)


def test_repeat_is_served_from_the_pool_with_the_same_output(baseline_run: EngineRun) -> None:
    result = baseline_run.result
    (first, _variant) = result.round(FIRST)
    (hit,) = result.round(POOL_HIT)
    assert first.num_cached_tokens == 0
    assert hit.num_cached_tokens == CACHEABLE_TOKENS
    assert_same_output(hit, first)


def test_returning_prompt_is_recomputed_with_the_same_tokens(baseline_run: EngineRun) -> None:
    result = baseline_run.result
    (first, _variant) = result.round(FIRST)
    (returned,) = result.round(RETURN)
    assert all(r.num_cached_tokens == 0 for r in result.round(FILLER))
    assert returned.num_cached_tokens == 0  # the fillers evicted all of it
    assert_same_output(returned, first)


def test_output_depends_on_the_whole_prompt(baseline_run: EngineRun) -> None:
    """The variant differs only in its first token: its outputs differ visibly."""
    first, variant = baseline_run.result.round(FIRST)
    top_first = first.logprobs[0][first.token_ids[0]]
    top_variant = variant.logprobs[0][variant.token_ids[0]]
    assert variant.token_ids != first.token_ids or abs(top_first - top_variant) > 1e-2
    assert len(first.token_ids) == 4
    assert all(len(pos) >= 2 for pos in first.logprobs)
