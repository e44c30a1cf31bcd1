"""kvtier's disk and Redis tiers as secondary tiers of vLLM's `TieringOffloadingSpec`.

```json
"secondary_tiers": [
  {"type": "KvtierDiskTier", "module_path": "kvtier.vllm",
   "path": "/mnt/nvme/kvtier", "bytes_to_use": 200000000000},
  {"type": "KvtierRedisTier", "module_path": "kvtier.vllm",
   "url": "redis://:pw@10.0.0.5:6379/0"}
]
```

What each does when its medium is down, full or corrupt is in the README ("kvtier's
tiers inside vLLM's tiering layer"); the contract they keep is in
`secondary_tiers_base`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Sequence
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.offload.policies import get_policy_class
from kvtier.remote.breaker import BreakerConfig
from kvtier.remote.remote_config import RemoteConfig
from kvtier.remote.remote_manager import RemoteLoadStoreSpec
from kvtier.remote.tier import RemoteTier
from kvtier.store.disk_store import DiskStore
from kvtier.types import BlockHash
from kvtier.vllm.tiering.tier_base import KvtierSecondaryTier
from kvtier.vllm.tiering.tier_lookup import KeyLookups


def _positions(hashes: Sequence[BlockHash], chosen: Collection[BlockHash]) -> list[int]:
    wanted = set(chosen)
    return [i for i, h in enumerate(hashes) if h in wanted]


class KvtierDiskTier(KvtierSecondaryTier):
    """kvtier's crash-safe disk tier: one checksummed file per block, written durably
    (temp file, fsync, rename), never more than `bytes_to_use` bytes (kvtier's policy
    evicts, `eviction_policy`, default "lru"), and found again after a restart."""

    medium: ClassVar[Medium] = Medium.STORAGE
    OPTIONS = frozenset({"path", "bytes_to_use", "eviction_policy", "fsync", "io_threads"})
    REQUIRED = frozenset({"path", "bytes_to_use"})
    DEFAULT_LOCALITY = Locality.LOCAL

    def open(self, options: dict[str, Any]) -> None:
        policy = options.get("eviction_policy", "lru")
        get_policy_class(policy)  # a wrong name fails before the directory is taken
        self.store = DiskStore(
            options["path"],
            self.layout,
            int(options["bytes_to_use"]),
            fsync=bool(options.get("fsync", True)),
            io_threads=int(options.get("io_threads", 2)),
        )
        self.manager = self.store.manager(self.tokens_per_chunk, policy)

    def key(self, key: OffloadKey) -> BlockHash:
        # vLLM's keys (block hash + group index) can be longer than the 32 bytes the
        # disk store counts each file's name with: name files by a 32-byte digest
        return BlockHash(hashlib.blake2b(key, digest_size=32).digest())

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.manager.lookup([self.key(key)]) else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.touch([self.key(k) for k in keys])

    def reserve(self, hashes: list[BlockHash]) -> list[int] | None:
        out = self.manager.prepare_store(hashes)
        return None if out is None else _positions(hashes, out.block_hashes_to_store)

    def stored(self, hashes: list[BlockHash], success: bool) -> None:
        self.manager.complete_store(hashes, success)

    def pin(self, hashes: list[BlockHash]) -> list[int]:
        blocks = [self.manager.get_block(h) for h in hashes]
        ready = [i for i, b in enumerate(blocks) if b is not None and b.ref_cnt >= 0]
        if ready:
            pinned = [hashes[i] for i in ready]
            self.manager.prepare_load(pinned)
            self.manager.touch(pinned)  # a promotion is a use
        return ready

    def loaded(self, pinned: list[BlockHash], failed: list[OffloadKey]) -> None:
        if pinned:
            self.manager.complete_load(pinned)
        # what the store found missing or corrupt, and whatever failed to load: gone
        self.manager.discard(self.store.take_dropped() + [self.key(k) for k in failed])

    def write(self, hashes: Sequence[BlockHash], rows: Sequence[memoryview]) -> None:
        self.store.write(hashes, rows)

    def read(self, hashes: Sequence[BlockHash], rows: Sequence[memoryview]) -> None:
        self.store.read(hashes, rows)

    def close(self) -> None:
        self.store.close()


REMOTE_OPTIONS = frozenset(f.name for f in dataclasses.fields(RemoteConfig))
BREAKER_OPTIONS = sorted(f.name for f in dataclasses.fields(BreakerConfig))


def _remote_options(options: dict[str, Any]) -> dict[str, Any]:
    """JSON values as `RemoteConfig` takes them (lists as tuples, the breaker's dict)."""
    options = dict(options)
    if "cluster_nodes" in options:
        options["cluster_nodes"] = tuple(options["cluster_nodes"])
    breaker = options.get("breaker")
    if isinstance(breaker, dict):
        unknown = sorted(set(breaker) - set(BREAKER_OPTIONS))
        if unknown:
            raise ValueError(
                f"KvtierRedisTier: unknown breaker option {unknown[0]!r}; "
                f"allowed: {BREAKER_OPTIONS}"
            )
        options["breaker"] = BreakerConfig(**breaker)
    return options


class KvtierRedisTier(KvtierSecondaryTier):
    """kvtier's Redis tier, shared by every engine of the same model: checksummed
    values, a timeout on every call and a circuit breaker, so a slow or dead server
    costs misses, never a stalled step; Redis evicts (maxmemory policy)."""

    medium: ClassVar[Medium] = Medium.CPU  # memory, on another machine (REMOTE)
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    OPTIONS = REMOTE_OPTIONS
    REQUIRED = frozenset({"url"})
    DEFAULT_LOCALITY = Locality.REMOTE

    def open(self, options: dict[str, Any]) -> None:
        options = _remote_options(options)
        url = options.pop("url")
        self.remote = RemoteTier.from_url(
            url, self.layout, block_size=self.tokens_per_chunk, **options
        )
        self.manager = self.remote.manager()
        self.kv_store = self.remote.kv_store(self.layout)
        store = self.remote.store
        self.lookups = KeyLookups(store.try_count_prefix, "redis", store.breaker.rejecting)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.lookups.lookup(key, req_context.req_id)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.lookups.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.lookups.cleanup(req_context.req_id)

    def reserve(self, hashes: list[BlockHash]) -> list[int] | None:
        if self.remote.store.breaker.rejecting():
            return None  # known down: skip the copy of a write that could only fail
        out = self.manager.prepare_store(hashes)
        return None if out is None else _positions(hashes, out.block_hashes_to_store)

    def stored(self, hashes: list[BlockHash], success: bool) -> None:
        self.manager.complete_store(hashes, success)

    def pin(self, hashes: list[BlockHash]) -> list[int]:
        if self.remote.store.breaker.rejecting():
            return []
        self.manager.prepare_load(hashes)
        return list(range(len(hashes)))

    def loaded(self, pinned: list[BlockHash], failed: list[OffloadKey]) -> None:
        if pinned:
            self.manager.complete_load(pinned)
        self.lookups.mark_miss(failed)

    def write(self, hashes: Sequence[BlockHash], rows: Sequence[memoryview]) -> None:
        self.kv_store.write_blocks(RemoteLoadStoreSpec(list(hashes)), rows)

    def read(self, hashes: Sequence[BlockHash], rows: Sequence[memoryview]) -> None:
        self.kv_store.read_blocks(RemoteLoadStoreSpec(list(hashes)), rows)

    def close(self) -> None:
        self.lookups.close()
        self.manager.close()
        self.remote.close()
