"""The shared remote tier: KV blocks in Redis, reused across engine instances.

Start from `RemoteTier.from_url(url, layout, block_size=...)`; see `tier.py`.
"""

from kvtier.remote.breaker import BreakerConfig, BreakerState, CircuitBreaker
from kvtier.remote.codec import BlockCodec, DecodeStatus
from kvtier.remote.kv_store import RedisKVStore, RemoteStoreError
from kvtier.remote.redis_store import RedisBlockStore, RemoteStartupError
from kvtier.remote.remote_config import RemoteConfig
from kvtier.remote.remote_manager import RemoteLoadStoreSpec, RemoteOffloadingManager
from kvtier.remote.remote_stats import RemoteStats
from kvtier.remote.tier import RemoteTier

__all__ = [
    "BlockCodec",
    "BreakerConfig",
    "BreakerState",
    "CircuitBreaker",
    "DecodeStatus",
    "RedisBlockStore",
    "RedisKVStore",
    "RemoteConfig",
    "RemoteLoadStoreSpec",
    "RemoteOffloadingManager",
    "RemoteStartupError",
    "RemoteStats",
    "RemoteStoreError",
    "RemoteTier",
]
