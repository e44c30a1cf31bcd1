"""Shared helpers for the GPU manager tests: construction, full-state snapshots, and the
scheduler's part of a step (the manager never advances `num_computed_tokens`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier import KVCacheManager, Request
from kvtier.gpu.block import KVCacheBlock


def make(num_blocks: int = 10, block_size: int = 4, **kwargs: Any) -> KVCacheManager:
    options: dict[str, Any] = {
        "max_model_len": 256,
        "num_preallocate_tokens": 0,
        "enable_kv_cache_events": True,
        **kwargs,
    }
    return KVCacheManager(block_size, num_blocks, **options)


def snapshot(manager: KVCacheManager, request_ids: list[str]) -> dict[str, Any]:
    """Everything a rejected call must leave untouched."""
    pool = manager.block_pool
    return {
        "free": [b.block_id for b in pool.free_block_queue],
        "ref": [b.ref_cnt for b in pool.blocks],
        "hash": [b.block_hash for b in pool.blocks],
        "index": sorted((h, [b.block_id for b in bs]) for h, bs in pool.cached_items()),
        "tables": {r: manager.get_block_ids(r) for r in request_ids if manager.has_request(r)},
        "cached": {
            r: manager.get_num_cached_blocks(r) for r in request_ids if manager.has_request(r)
        },
    }


def allocate(
    manager: KVCacheManager,
    request: Request,
    num_tokens: int,
    computed_blocks: Sequence[KVCacheBlock] | None = None,
    **kwargs: Any,
) -> list[KVCacheBlock] | None:
    """`allocate_slots`, then the scheduler's part: advance `num_computed_tokens`."""
    new = manager.allocate_slots(request, num_tokens, computed_blocks, **kwargs)
    if new is not None:
        num_hit = len(computed_blocks or ()) * manager.block_size
        request.num_computed_tokens += num_hit + num_tokens
    return new


def append(manager: KVCacheManager, request: Request, num_tokens: int) -> list[KVCacheBlock] | None:
    """`append_slots`, then the scheduler's part: advance `num_computed_tokens`."""
    new = manager.append_slots(request, num_tokens)
    if new is not None:
        request.num_computed_tokens += num_tokens
    return new
