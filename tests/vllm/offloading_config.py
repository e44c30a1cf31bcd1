"""vLLM's `OffloadingConfig` for one engine on one worker, as the connector builds it:
the tests that drive an offloading spec in process (no engine) all start from here."""

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
) -> OffloadingConfig:
    """One KV-cache group of `num_layers` layers; a fresh engine id per call."""
    layers = tuple(f"l{i}" for i in range(num_layers))
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block, layers, 0),),
        worker_kv_bytes_per_block=kv_bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=dict(extra),
        engine_id=f"kvtier-test-{os.getpid()}-{next(_engines)}",
        model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
