"""One offloading manager for any backend and any cache policy.

The manager owns what vLLM's managers own (reference counts, the store/load
two-phase protocol, events) and delegates ordering to a `CachePolicy` and slots
to a `Backend`; `CPUOffloadingManager`, `LRUOffloadingManager` and
`ARCOffloadingManager` are constructors over it, so the decisions are made in one
place. Decisions are vLLM 0.19's (see docs/semantics.md sections 3 and 4); on top,
caller mistakes raise KeyError/ValueError with the state unchanged instead of
tripping asserts half way, and counters record what happened. Every deliberate
difference from vLLM (repeated hashes, key checks, errors) is listed in
docs/vllm-differences.md.

Speed: the policy's own maps are the only hash -> block index (a second one would
double the dictionary work per stored block), read in one batched `get_many` call
per manager call; per-block loops run as C-level `map`/`filter` where they can.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import compress
from typing import Any, Literal

from kvtier.offload.abstract import (
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    RecordedEvents,
    block_hash_list,
    unique_hashes,
)
from kvtier.offload.backend import Backend, BlockStatus
from kvtier.offload.cpu import CPUBackend
from kvtier.offload.offloading_stats import OffloadingStats
from kvtier.offload.policies.base import CachePolicy
from kvtier.offload.policies.registry import create_policy
from kvtier.types import BlockHash


def _not_loadable(call: str, block_hash: BlockHash, block: BlockStatus | None) -> Exception:
    """The error for a block `call` cannot take, described as it was when seen."""
    if block is None:
        return KeyError(f"{call}: block {block_hash!r} is not stored")
    if call == "prepare_load":
        return ValueError(f"{call}: block {block_hash!r} is not ready (store in flight)")
    return ValueError(
        f"{call}: block {block_hash!r} is not being loaded (ref_cnt {block.ref_cnt}, expected > 0)"
    )


class PolicyOffloadingManager(RecordedEvents, OffloadingManager):
    """A `Backend` (where blocks live) driven by a `CachePolicy` (which to evict)."""

    def __init__(
        self,
        backend: Backend,
        policy: CachePolicy | str = "lru",
        enable_events: bool = False,
    ) -> None:
        self.backend = backend
        if isinstance(policy, str):
            capacity = backend.num_blocks
            if capacity is None:  # vLLM's fallback for backends without a fixed size
                capacity = backend.get_num_free_blocks()
            policy = create_policy(policy, capacity)
        self.policy: CachePolicy = policy
        # bound once: these run on every call
        self._get_many = policy.get_many
        self._get_iter = policy.get_iter
        self._get = policy.get
        self._absent = policy.absent
        self._touch = policy.touch
        self._evict_split = policy.evict_split
        self._insert_many = policy.insert_many
        self._mark_evictable = policy.mark_evictable
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._num_present = 0
        self._lookups = self._queried = self._hits = self._loaded = 0
        self._stored = self._evicted = self._rejections = self._failed = 0

    # --- reading -----------------------------------------------------------

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        if type(block_hashes) is not list:
            block_hashes = list(block_hashes)
        hits = 0
        for block in self._get_iter(block_hashes):
            if block is None or block.ref_cnt < 0:
                break
            hits += 1
        self._lookups += 1
        self._queried += len(block_hashes)
        self._hits += hits
        return hits

    def lookup_one(self, block_hash: BlockHash) -> bool:
        """`lookup([block_hash]) == 1`, counted the same, without the list: vLLM 0.32
        asks about one key at a time, and this is the scheduler's hottest call."""
        block = self._get(block_hash)
        hit = block is not None and block.ref_cnt >= 0
        self._lookups += 1
        self._queried += 1
        self._hits += hit
        return hit

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        """Pin each listed block once per listing, as vLLM does (a hash listed twice is
        loaded into two places, and `complete_load` of the same list releases both)."""
        hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
        blocks: list[Any] = self._blocks_of("prepare_load", hashes)
        for i, block in enumerate(blocks):
            if block is None or block.ref_cnt < 0:
                error = _not_loadable("prepare_load", hashes[i], block)
                for pinned in blocks[:i]:  # undo: the state is unchanged after an error
                    pinned.ref_cnt -= 1
                block_hash_list("prepare_load", hashes)  # a key that is not bytes: say so
                raise error
            block.ref_cnt += 1
        self._loaded += len(blocks)
        return self.backend.get_load_store_spec(hashes, blocks)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        # checked first: the policy applies a touch key by key, so an unhashable key
        # found late would leave the earlier ones refreshed
        self._touch(block_hash_list("touch", block_hashes))

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        """Unpin; a hash listed k times releases k loads (an error if fewer are in flight)."""
        hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
        blocks: list[Any] = self._blocks_of("complete_load", hashes)
        for i, block in enumerate(blocks):
            if block is None or block.ref_cnt <= 0:
                error = _not_loadable("complete_load", hashes[i], block)
                for released in blocks[:i]:  # undo: the state is unchanged after an error
                    released.ref_cnt += 1
                block_hash_list("complete_load", hashes)  # a key that is not bytes: say so
                raise error
            block.ref_cnt -= 1
        self._mark_evictable(hashes)

    def _blocks_of(self, call: str, hashes: list[BlockHash]) -> list[BlockStatus | None]:
        """The policy's blocks for `hashes`; ValueError naming an unhashable key.

        Keys are checked only where a call fails or stores: a stored key is bytes
        (`prepare_store` refuses others), so a call whose blocks are all found needs
        no check, and the hot path pays nothing for it.
        """
        try:
            return self._get_many(hashes)
        except TypeError:
            block_hash_list(call, hashes)  # raises ValueError naming the key
            raise

    # --- writing -----------------------------------------------------------

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """A hash listed twice is stored once (vLLM would give it a second slot)."""
        hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
        try:
            protected = set(hashes)
        except TypeError:
            block_hash_list("prepare_store", hashes)  # raises ValueError naming the key
            raise
        if len(protected) != len(hashes):
            hashes = unique_hashes(hashes)
        to_store = self._absent(hashes)
        backend = self.backend
        if not to_store:
            return PrepareStoreOutput([], backend.get_load_store_spec([], []), [])
        block_hash_list("prepare_store", to_store)  # only bytes are ever stored
        evicted: list[BlockHash] = []
        num_to_evict = len(to_store) - backend.get_num_free_blocks()
        if num_to_evict > 0:
            victims = self._evict_split(num_to_evict, protected)
            if victims is None:
                self._rejections += 1
                return None
            evicted = victims[0]
            backend.free_blocks(victims[1])
            self._evicted += len(evicted)
            if self.events is not None:
                self.events.append(
                    OffloadingEvent(evicted, backend.block_size, backend.medium, removed=True)
                )
        new_blocks = backend.allocate_blocks(to_store)
        if len(new_blocks) != len(to_store):
            raise RuntimeError(
                f"{type(backend).__name__}.allocate_blocks returned {len(new_blocks)} "
                f"blocks for {len(to_store)} hashes"
            )
        self._insert_many(to_store, new_blocks)
        self._num_present += len(to_store) - len(evicted)
        return PrepareStoreOutput(
            to_store, backend.get_load_store_spec(to_store, new_blocks), evicted
        )

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Settle the in-flight blocks among the hashes, each once however often listed;
        others (absent, ready) are ignored, as in vLLM."""
        hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
        blocks: list[Any] = self._blocks_of("complete_store", hashes)
        in_flight = bool(blocks) and None not in blocks
        if in_flight:
            for block in blocks:  # (a loop: `map` of an attrgetter costs more per block)
                if block.ref_cnt >= 0:
                    in_flight = False
                    break
        if not in_flight:
            # not the usual case (all in flight): keep only the in-flight ones
            block_hash_list("complete_store", hashes)  # a key that is not bytes: say so
            keep = [b is not None and b.ref_cnt < 0 for b in blocks]
            hashes, blocks = list(compress(hashes, keep)), list(compress(blocks, keep))
            if not hashes:
                return
        if len(hashes) > 1 and len(set(hashes)) != len(hashes):  # settle each hash once
            unique = dict(zip(hashes, blocks, strict=True))
            hashes, blocks = list(unique), list(unique.values())
        if not success:
            self._drop(hashes, blocks)
            return
        for block in blocks:
            block.ref_cnt = 0
        self._stored += len(hashes)
        self._mark_evictable(hashes)
        if self.events is not None:
            backend = self.backend
            stored = list(hashes)
            self.events.append(
                OffloadingEvent(stored, backend.block_size, backend.medium, removed=False)
            )

    def _drop(self, hashes: list[BlockHash], blocks: list[BlockStatus]) -> None:
        """A failed store: forget its blocks and free their slots, in input order."""
        for block_hash, block in zip(hashes, blocks, strict=True):
            self.policy.remove(block_hash)
            self.backend.free(block)
        self._num_present -= len(hashes)
        self._failed += len(hashes)

    def remove_ready(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """Forget ready, unpinned blocks (e.g. found corrupt) and free their slots.

        Absent, pinned and in-flight blocks are left alone. One removal event lists
        those removed, which are returned in input order.
        """
        removed: list[BlockHash] = []
        for block_hash in block_hash_list("remove_ready", block_hashes):
            block = self.policy.get(block_hash)
            if block is not None and block.ref_cnt == 0:
                self.policy.remove(block_hash)
                self.backend.free(block)
                removed.append(block_hash)
        self._num_present -= len(removed)
        if removed and self.events is not None:
            backend = self.backend
            self.events.append(
                OffloadingEvent(removed, backend.block_size, backend.medium, removed=True)
            )
        return removed

    def reset_cache(self) -> list[BlockHash]:
        """Forget every block, pinned and in flight included, and free every slot.

        For a prefix-cache reset (new weights): no block stored before it may be served
        again. Whoever pinned a block or has a store in flight must not complete it
        afterwards (vLLM drops the jobs of before a reset); the caller also waits for the
        data plane to finish with the freed slots before reusing them (vLLM flushes its
        jobs before the next). The policy keeps what it learned about access patterns
        (ghosts, reuse history): those are about keys, not about the bytes. Returns the
        keys forgotten, also listed in one removal event.
        """
        keys = self.policy.stored_keys()
        blocks = [b for b in self._get_many(keys) if b is not None]
        remove = self.policy.remove
        for key in keys:
            remove(key)
        self.backend.free_blocks(blocks)
        self._num_present = 0
        if keys and self.events is not None:
            backend = self.backend
            self.events.append(OffloadingEvent(keys, backend.block_size, backend.medium, True))
        return keys

    @property
    def _policy(self) -> CachePolicy:
        """vLLM's name for `policy` (its tests and tools that inspect a policy read it)."""
        return self.policy

    # --- beyond vLLM -------------------------------------------------------

    @property
    def counters(self) -> OffloadingStats:
        return OffloadingStats(
            lookups=self._lookups,
            queried_blocks=self._queried,
            hit_blocks=self._hits,
            loaded_blocks=self._loaded,
            stored_blocks=self._stored,
            evicted_blocks=self._evicted,
            store_rejections=self._rejections,
            failed_stores=self._failed,
        )

    def __len__(self) -> int:
        """Blocks present (ready or in flight)."""
        return self._num_present

    def __contains__(self, block_hash: object) -> bool:
        return self.policy.get(block_hash) is not None  # type: ignore[arg-type]

    def get_block(self, block_hash: BlockHash) -> BlockStatus | None:
        return self.policy.get(block_hash)


class LRUOffloadingManager(PolicyOffloadingManager):
    def __init__(self, backend: Backend, enable_events: bool = False) -> None:
        super().__init__(backend, "lru", enable_events)


class ARCOffloadingManager(PolicyOffloadingManager):
    def __init__(self, backend: Backend, enable_events: bool = False) -> None:
        super().__init__(backend, "arc", enable_events)


class CPUOffloadingManager(PolicyOffloadingManager):
    """vLLM's `CPUOffloadingManager`: CPU slots 0..num_blocks-1 and a policy by name.

    `cache_policy` takes any registered name or "module:Class" path, not only
    "lru" and "arc". `reuse_freed_first`: hand out freed slots before never-used ones
    (`CPUBackend`; not vLLM's order, off by default).
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        cache_policy: Literal["lru", "arc"] | str = "lru",
        enable_events: bool = False,
        *,
        reuse_freed_first: bool = False,
    ) -> None:
        backend = CPUBackend(block_size, num_blocks, reuse_freed_first=reuse_freed_first)
        super().__init__(backend, cache_policy, enable_events)
        self.block_size = block_size
        self.medium = self.backend.medium
