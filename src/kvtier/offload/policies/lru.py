"""Least recently used: evict the least recent evictable, unprotected blocks."""

from __future__ import annotations

from collections.abc import Sequence, Set

from kvtier.offload.backend import BlockStatus
from kvtier.offload.policies.base import CachePolicy, Victims
from kvtier.offload.policies.recency import RecencyList
from kvtier.types import BlockHash


class LRUCachePolicy(CachePolicy):
    """One recency list. `cache_capacity` is accepted for a uniform constructor only."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._list = RecencyList()

    def __len__(self) -> int:
        return len(self._list)

    def get(self, key: BlockHash) -> BlockStatus | None:
        return self._list.get(key)

    def insert(self, key: BlockHash, block: BlockStatus) -> None:
        self._list.order[key] = block

    def insert_many(self, keys: Sequence[BlockHash], blocks: Sequence[BlockStatus]) -> None:
        self._list.order.update(zip(keys, blocks, strict=True))

    def remove(self, key: BlockHash) -> None:
        self._list.pop(key)

    def touch(self, keys: Sequence[BlockHash]) -> None:
        lst = self._list
        order = lst.order
        move_to_end = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move_to_end(key)
            elif lst.parked:
                lst.move_to_end(key)

    def evict(self, n: int, protected: Set[BlockHash]) -> Victims | None:
        if n <= 0:
            return []
        scan = self._list.scan(protected)
        victims: Victims = []
        while len(victims) < n:
            victim = scan.next()
            if victim is None:
                scan.abort()
                return None
            victims.append(victim)
        scan.commit()
        return victims

    def mark_evictable(self, keys: Sequence[BlockHash]) -> None:
        lst = self._list
        if lst.parked:
            for key in keys:
                lst.mark_evictable(key)

    def keys(self) -> list[BlockHash]:
        """Stored keys, least recent first."""
        return self._list.keys()
