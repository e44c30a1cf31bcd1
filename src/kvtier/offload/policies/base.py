"""What a cache policy is: the ordering of the stored blocks, and the choice of victims.

Policies own ordering only. The manager owns slots, reference counts and events
and tells the policy about every block that enters, leaves or is used, so a new
policy is one small class (see `lru.py`) plus one line in `registry.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence, Set

from kvtier.offload.backend import BlockStatus
from kvtier.types import BlockHash

Victims = list[tuple[BlockHash, BlockStatus]]


class CachePolicy(ABC):
    """vLLM's `CachePolicy` contract, with victims as two lists, plus hooks for speed.

    `evict_split(n, protected)` is atomic: exactly n victims (removed from the policy)
    or None and no change; `evict` gives them as vLLM's pairs. A victim always has
    `ref_cnt == 0` and is never in `protected`. Keys passed to `touch` may be absent
    (ignored).
    """

    def __init__(self, cache_capacity: int) -> None:
        if cache_capacity < 0:
            raise ValueError(f"cache_capacity must be >= 0, got {cache_capacity}")
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: BlockHash) -> BlockStatus | None:
        """The stored block for `key`, or None."""

    def get_iter(self, keys: Iterable[BlockHash]) -> Iterator[BlockStatus | None]:
        """`get` for each key, lazily (a lookup stops at its first miss)."""
        return map(self.get, keys)

    def get_many(self, keys: Sequence[BlockHash]) -> list[BlockStatus | None]:
        """`get` for each key, in order; override to save a call per key."""
        return [self.get(key) for key in keys]

    def absent(self, keys: Sequence[BlockHash]) -> list[BlockHash]:
        """The keys without a stored block, in order; override to skip fetching blocks."""
        return [key for key, block in zip(keys, self.get_many(keys), strict=True) if block is None]

    @abstractmethod
    def insert(self, key: BlockHash, block: BlockStatus) -> None:
        """Add a newly allocated block (absent before)."""

    def insert_many(self, keys: Sequence[BlockHash], blocks: Sequence[BlockStatus]) -> None:
        """Insert several blocks in order; override to save a call per block."""
        for key, block in zip(keys, blocks, strict=True):
            self.insert(key, block)

    @abstractmethod
    def remove(self, key: BlockHash) -> None:
        """Forget a block (a failed store); absent keys are ignored."""

    @abstractmethod
    def touch(self, keys: Sequence[BlockHash]) -> None:
        """Record a use of `keys`, applied in REVERSE order (a prefix's head ends most recent)."""

    @abstractmethod
    def evict_split(
        self, n: int, protected: Set[BlockHash]
    ) -> tuple[list[BlockHash], list[BlockStatus]] | None:
        """Exactly n victims in eviction order, removed from the policy, as (keys, blocks);
        or None and no change. The manager calls this: two lists cost less than pairs."""

    def evict(self, n: int, protected: Set[BlockHash]) -> Victims | None:
        """`evict_split` as vLLM's (key, block) pairs."""
        split = self.evict_split(n, protected)
        return None if split is None else list(zip(*split, strict=True))

    def mark_evictable(self, keys: Sequence[BlockHash]) -> None:
        """Some of `keys` may just have dropped to `ref_cnt == 0` (loaded or stored).

        A hook, not a contract: policies that keep non-evictable blocks out of their
        scan order use it to put them back; a scanning policy ignores it.
        """
        return None

    def stored_keys(self) -> list[BlockHash]:
        """Every stored key, in no promised order: what a reset must forget (the manager
        has no index of its own). A policy that cannot list them cannot be reset."""
        raise NotImplementedError(
            f"{type(self).__name__} does not list its keys (CachePolicy.stored_keys), so a "
            "manager over it cannot reset; implement stored_keys() to allow reset_cache()"
        )

    def ghost_sizes(self) -> tuple[int, ...]:
        """Sizes of the ghost lists, if the policy keeps any (for invariants and tests)."""
        return ()
