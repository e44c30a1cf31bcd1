"""The engine tests' workloads: prompts that overflow a small engine pool.

`overflow_job` is the one the equivalence tests share: the same job runs on vLLM's
baseline engine (no connector) and, with a `kv_transfer_config`, on an engine with an
offloading connector; rounds are named so a test reads `result.round("return")`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.vllm.engines import EngineJob, Round, random_prompts

BLOCK = 32
POOL_BLOCKS = 24  # 23 usable: vLLM keeps one as its null block
PROMPT_TOKENS = 200  # 6 full blocks + 8 tokens: 192 tokens can come from a cache
CACHEABLE_TOKENS = (PROMPT_TOKENS // BLOCK) * BLOCK
FILLERS = 5  # 5 x 7 blocks > 23: nothing of the returning prompt stays in the pool

# round names, in the order the job serves them
FIRST, POOL_HIT, FILLER, RETURN = "first", "pool_hit", "filler", "return"


def overflow_rounds(vocab: int, seed: int = 0) -> tuple[Round, ...]:
    """A prompt (and a variant differing in its first token), the same prompt again
    (a hit in the engine's pool), fillers that evict it, then the prompt returning."""
    first, *fillers = random_prompts(1 + FILLERS, PROMPT_TOKENS, vocab, seed)
    variant = ((first[0] + 1) % vocab, *first[1:])
    return (
        Round((first, variant), name=FIRST),
        Round((first,), name=POOL_HIT),
        Round(tuple(fillers), max_tokens=1, logprobs=1, name=FILLER),
        Round((first,), name=RETURN),
    )


def overflow_job(
    model: Path, vocab: int, kv_transfer_config: dict[str, Any] | None = None, **job: Any
) -> EngineJob:
    return EngineJob(
        model=model,
        rounds=overflow_rounds(vocab),
        block_size=BLOCK,
        num_blocks=POOL_BLOCKS,
        kv_transfer_config=kv_transfer_config,
        **job,
    )
