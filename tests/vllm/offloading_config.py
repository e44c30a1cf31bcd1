"""vLLM's `OffloadingConfig` for one engine, as the connector builds it: the tests that
drive an offloading spec in process (no engine) all start from here. One worker and one
KV-cache group unless asked (`tp`, `rank`, `pp`; `groups` of `num_layers` layers each,
as vLLM groups a hybrid model's layers)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from typing import Any

from tests.vllm.needs_vllm import quiet

with quiet():
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

_engines = itertools.count()


def offloading_config(
    extra: Mapping[str, Any],
    *,
    kv_bytes_per_block: int,
    num_layers: int = 2,
    tokens_per_block: int = 32,
    events: bool = False,
    model: str = "tiny-test-model",
    groups: int = 1,
    tp: int = 1,
    rank: int = 0,
    pp: int = 1,
    engine_id: str | None = None,
) -> OffloadingConfig:
    """`groups` KV-cache groups of `num_layers` layers; a fresh engine id per call
    unless given (the scheduler and the workers of one engine share theirs)."""
    group_configs = tuple(
        OffloadingGroupConfig(
            tokens_per_block, tuple(f"l{g * num_layers + i}" for i in range(num_layers)), g
        )
        for g in range(groups)
    )
    return OffloadingConfig(
        groups=group_configs,
        worker_kv_bytes_per_block=kv_bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=dict(extra),
        engine_id=engine_id or f"kvtier-test-{os.getpid()}-{next(_engines)}",
        model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp * pp,
            tp_size=tp,
            pp_size=pp,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=groups == 1,
        ),
    )
