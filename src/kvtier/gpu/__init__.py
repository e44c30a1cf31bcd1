"""The accelerator-side (GPU tier) block pool and request-level manager with prefix caching.

Bookkeeping only: block ids, reference counts, hashes and eviction order. The engine
owns the memory those ids index.
"""

from kvtier.gpu.block import KVCacheBlock
from kvtier.gpu.block_pool import BlockPool
from kvtier.gpu.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvtier.gpu.free_queue import FreeKVCacheBlockQueue
from kvtier.gpu.kv_cache_manager import KVCacheManager
from kvtier.gpu.prefix_cache_stats import PrefixCacheStats

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "PrefixCacheStats",
]
