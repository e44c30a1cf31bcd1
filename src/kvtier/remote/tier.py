"""One object to build the remote tier from a URL: what the replay and engines call.

```python
tier = RemoteTier.from_url("redis://:pw@10.0.0.5:6379/0", layout, block_size=16)
manager = tier.manager()                  # an OffloadingManager, medium "REMOTE"
kv_store = tier.kv_store(layout)          # a BlockStore for TransferWorker.for_store
print(tier.stats)                         # hits, bytes per direction, faults
```

`layout` is a `KVLayout` (its fingerprint namespaces the keys and is checked in
every value) or, for tools without one, the fingerprint itself as str/bytes.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from kvtier.remote.head_keys import HeadKeyedStore
from kvtier.remote.head_shard import HeadShard, HeadShardKVStore
from kvtier.remote.kv_store import RedisKVStore
from kvtier.remote.redis_store import RedisBlockStore
from kvtier.remote.remote_config import RemoteConfig
from kvtier.remote.remote_manager import RemoteOffloadingManager
from kvtier.remote.remote_stats import RemoteStats
from kvtier.store.layout import KVLayout
from kvtier.validate import positive_int


class HasFingerprint(Protocol):
    @property
    def fingerprint(self) -> str: ...


def fingerprint_of(layout: str | bytes | HasFingerprint) -> str | bytes:
    if isinstance(layout, str | bytes):
        return layout
    return layout.fingerprint


class RemoteTier:
    def __init__(self, store: RedisBlockStore, block_size: int) -> None:
        positive_int("block_size", block_size)
        self.store = store
        self.block_size = block_size
        # weakly held: a service that makes a manager per tenant and drops it must not
        # keep them all alive; the ones still alive are closed with the tier
        self._managers: weakref.WeakSet[RemoteOffloadingManager] = weakref.WeakSet()

    @classmethod
    def from_url(
        cls,
        url: str,
        layout_fingerprint: str | bytes | HasFingerprint,
        *,
        block_size: int,
        clock: Callable[[], float] = time.monotonic,
        heads: int | None = None,
        group_heads: int | None = None,
        **options: Any,
    ) -> RemoteTier:
        """Connect (a wrong password raises `RemoteStartupError` here; a down server does not).

        `heads`: keep each block by KV head (`head_keys`), so engines of every
        tensor-parallel size share them, this engine's workers writing `group_heads` heads
        a value (default all of them); None: one value per block, for this layout only.
        `options` are `RemoteConfig` fields (password, socket_timeout_s, ttl_s,
        cluster_nodes, breaker, ...); an unknown one is a ValueError naming the known.
        """
        known = {f.name for f in dataclasses.fields(RemoteConfig)} - {"url"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown remote tier options {unknown}; known: {sorted(known)}")
        config = RemoteConfig(url=url, **options)
        fingerprint = fingerprint_of(layout_fingerprint)
        if heads is None:
            return cls(RedisBlockStore.connect(config, fingerprint, clock), block_size)
        store = HeadKeyedStore.connect_heads(config, fingerprint, heads, group_heads, clock)
        return cls(store, block_size)

    def manager(
        self,
        salt: str | None = None,
        *,
        enable_events: bool = False,
        synthetic_payload_bytes: int | None = None,
        async_lookup: bool = False,
    ) -> RemoteOffloadingManager:
        """An offloading manager over this tier's store (one per cache salt / tenant)."""
        manager = RemoteOffloadingManager(
            self.store,
            self.block_size,
            salt=salt,
            enable_events=enable_events,
            synthetic_payload_bytes=synthetic_payload_bytes,
            async_lookup=async_lookup,
        )
        self._managers.add(manager)
        return manager

    def kv_store(self, layout: KVLayout) -> RedisKVStore:
        """This tier as a `BlockStore` for `TransferWorker.for_store(kv, ...)`."""
        return RedisKVStore(self.store, layout)

    def head_store(self, layout: KVLayout, shard: HeadShard) -> HeadShardKVStore:
        """One worker's heads of this tier (opened with `heads`) as a `BlockStore`."""
        if not isinstance(self.store, HeadKeyedStore):
            raise TypeError("head_store needs a tier opened with heads=")
        return HeadShardKVStore(self.store, layout, shard)

    @property
    def stats(self) -> RemoteStats:
        return self.store.stats

    def close(self) -> None:
        for manager in list(self._managers):
            manager.close()
        self.store.close()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
