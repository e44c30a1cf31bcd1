"""KV cache events: what an external index (a router, an offload tier) needs to mirror the
GPU prefix cache. Shaped like vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.types import BlockHash

GPU_MEDIUM = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one request entered the prefix cache.

    `parent_block_hash` is the hash of the block before the first one (None at the
    start of a request); `token_ids` cover all the blocks, and are empty for a request
    built from block hashes (its tokens are unknown).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None
    medium: str = GPU_MEDIUM


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted from the prefix cache (their memory is being reused)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = GPU_MEDIUM


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: every earlier stored block is gone."""

    medium: str = GPU_MEDIUM


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
