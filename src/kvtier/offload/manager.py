"""One offloading manager for any backend and any cache policy.

The manager owns what vLLM's managers own (reference counts, the store/load
two-phase protocol, events) and delegates ordering to a `CachePolicy` and slots
to a `Backend`; `CPUOffloadingManager`, `LRUOffloadingManager` and
`ARCOffloadingManager` are constructors over it, so the decisions are made in one
place. Decisions are vLLM 0.19's (see docs/SEMANTICS.md sections 3 and 4); on top,
caller mistakes raise KeyError/ValueError with the state unchanged instead of
tripping asserts half way, and counters record what happened.

Hot paths keep their own hash -> block map (no policy call per lookup) and take
lists without copying them; every call is O(len(hashes)) plus the eviction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

from kvtier.offload.abstract import (
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from kvtier.offload.backend import Backend, BlockStatus
from kvtier.offload.counters import OffloadingCounters
from kvtier.offload.cpu import CPUBackend
from kvtier.offload.policies.base import CachePolicy
from kvtier.offload.policies.registry import create_policy
from kvtier.types import BlockHash


def _as_list(block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
    return block_hashes if type(block_hashes) is list else list(block_hashes)


def _check_distinct(call: str, hashes: list[BlockHash]) -> set[BlockHash]:
    distinct = set(hashes)
    if len(distinct) != len(hashes):
        seen: set[BlockHash] = set()
        dups = [h for h in hashes if h in seen or seen.add(h)]  # type: ignore[func-returns-value]
        raise ValueError(f"{call}: duplicate block hashes in one call: {dups!r}")
    return distinct


class PolicyOffloadingManager(OffloadingManager):
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
        self._blocks: dict[BlockHash, BlockStatus] = {}
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._lookups = self._queried = self._hits = self._loaded = 0
        self._stored = self._evicted = self._rejections = self._failed = 0

    # --- reading -----------------------------------------------------------

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        hashes = _as_list(block_hashes)
        get = self._blocks.get
        hits = 0
        for block_hash in hashes:
            block = get(block_hash)
            if block is None or block.ref_cnt < 0:
                break
            hits += 1
        self._lookups += 1
        self._queried += len(hashes)
        self._hits += hits
        return hits

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        hashes = _as_list(block_hashes)
        _check_distinct("prepare_load", hashes)
        get = self._blocks.get
        blocks: list[BlockStatus] = []
        for block_hash in hashes:
            block = get(block_hash)
            if block is None or block.ref_cnt < 0:
                for pinned in blocks:  # undo: the state is unchanged after an error
                    pinned.ref_cnt -= 1
                if block is None:
                    raise KeyError(f"prepare_load: block {block_hash!r} is not stored")
                raise ValueError(
                    f"prepare_load: block {block_hash!r} is not ready (store in flight)"
                )
            block.ref_cnt += 1
            blocks.append(block)
        self._loaded += len(blocks)
        return self.backend.get_load_store_spec(hashes, blocks)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        self.policy.touch(_as_list(block_hashes))

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        hashes = _as_list(block_hashes)
        _check_distinct("complete_load", hashes)
        get = self._blocks.get
        for i, block_hash in enumerate(hashes):
            block = get(block_hash)
            if block is None or block.ref_cnt <= 0:
                for done in hashes[:i]:
                    self._blocks[done].ref_cnt += 1
                if block is None:
                    raise KeyError(f"complete_load: block {block_hash!r} is not stored")
                raise ValueError(
                    f"complete_load: block {block_hash!r} is not being loaded "
                    f"(ref_cnt {block.ref_cnt}, expected > 0)"
                )
            block.ref_cnt -= 1
        self.policy.mark_evictable(hashes)

    # --- writing -----------------------------------------------------------

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        hashes = _as_list(block_hashes)
        protected = _check_distinct("prepare_store", hashes)
        blocks = self._blocks
        to_store = [h for h in hashes if h not in blocks]
        backend = self.backend
        if not to_store:
            return PrepareStoreOutput([], backend.get_load_store_spec([], []), [])
        evicted: list[BlockHash] = []
        num_to_evict = len(to_store) - backend.get_num_free_blocks()
        if num_to_evict > 0:
            victims = self.policy.evict(num_to_evict, protected)
            if victims is None:
                self._rejections += 1
                return None
            evicted = [h for h, _ in victims]
            for block_hash in evicted:
                del blocks[block_hash]
            backend.free_blocks([block for _, block in victims])
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
        blocks.update(zip(to_store, new_blocks, strict=True))
        self.policy.insert_many(to_store, new_blocks)
        spec = backend.get_load_store_spec(to_store, new_blocks)
        return PrepareStoreOutput(to_store, spec, evicted)

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        hashes = _as_list(block_hashes)
        get = self._blocks.get
        if not success:
            self._drop_in_flight(hashes)
            return
        stored: list[BlockHash] = []
        for block_hash in hashes:
            block = get(block_hash)
            if block is not None and block.ref_cnt < 0:
                block.ref_cnt = 0
                stored.append(block_hash)
        if stored:
            self._stored += len(stored)
            self.policy.mark_evictable(stored)
            if self.events is not None:
                backend = self.backend
                self.events.append(
                    OffloadingEvent(stored, backend.block_size, backend.medium, removed=False)
                )

    def _drop_in_flight(self, hashes: list[BlockHash]) -> None:
        """A failed store: forget its not-ready blocks and free their slots, in input order."""
        blocks = self._blocks
        for block_hash in hashes:
            block = blocks.get(block_hash)
            if block is not None and block.ref_cnt < 0:
                del blocks[block_hash]
                self.policy.remove(block_hash)
                self.backend.free(block)
                self._failed += 1

    def take_events(self) -> Iterator[OffloadingEvent]:
        """The recorded events in order; they are forgotten at once, consumed or not."""
        events = self.events
        if not events:
            return iter(())
        self.events = []
        return iter(events)

    # --- beyond vLLM -------------------------------------------------------

    @property
    def counters(self) -> OffloadingCounters:
        return OffloadingCounters(
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
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def get_block(self, block_hash: BlockHash) -> BlockStatus | None:
        return self._blocks.get(block_hash)

    def stored_hashes(self) -> Sequence[BlockHash]:
        return list(self._blocks)


class LRUOffloadingManager(PolicyOffloadingManager):
    def __init__(self, backend: Backend, enable_events: bool = False) -> None:
        super().__init__(backend, "lru", enable_events)


class ARCOffloadingManager(PolicyOffloadingManager):
    def __init__(self, backend: Backend, enable_events: bool = False) -> None:
        super().__init__(backend, "arc", enable_events)


class CPUOffloadingManager(PolicyOffloadingManager):
    """vLLM's `CPUOffloadingManager`: CPU slots 0..num_blocks-1 and a policy by name.

    `cache_policy` takes any registered name or "module:Class" path, not only
    "lru" and "arc".
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        cache_policy: Literal["lru", "arc"] | str = "lru",
        enable_events: bool = False,
    ) -> None:
        super().__init__(CPUBackend(block_size, num_blocks), cache_policy, enable_events)
        self.block_size = block_size
        self.medium = self.backend.medium
