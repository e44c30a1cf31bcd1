"""Least recently used: evict the least recent evictable, unprotected blocks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence, Set
from itertools import filterfalse

from kvtier.offload._fast import consume, first, pop_head, second
from kvtier.offload.backend import BlockStatus
from kvtier.offload.policies.base import CachePolicy, Victims
from kvtier.offload.structures.recency_list import RecencyList
from kvtier.types import BlockHash


class LRUCachePolicy(CachePolicy):
    """One recency list. `cache_capacity` is accepted for a uniform constructor only."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._list = RecencyList()

    def __len__(self) -> int:
        return len(self._list)

    @property
    def blocks(self) -> RecencyList:
        """vLLM's name for the one list (`len(policy.blocks)`, `h in policy.blocks`)."""
        return self._list

    def stored_keys(self) -> list[BlockHash]:
        return [*self._list.order, *self._list.parked]

    def get(self, key: BlockHash) -> BlockStatus | None:
        return self._list.get(key)

    def get_iter(self, keys: Iterable[BlockHash]) -> Iterator[BlockStatus | None]:
        lst = self._list
        if not lst.parked:
            return map(lst.order.get, keys)
        keys = keys if isinstance(keys, list) else list(keys)
        return map(lst.order.get, keys, map(lst.parked.get, keys))  # both C-level

    def get_many(self, keys: Sequence[BlockHash]) -> list[BlockStatus | None]:
        lst = self._list
        return list(map(lst.order.get, keys) if not lst.parked else self.get_iter(keys))

    def absent(self, keys: Sequence[BlockHash]) -> list[BlockHash]:
        lst = self._list
        missing = filterfalse(lst.order.__contains__, keys)
        return list(filterfalse(lst.parked.__contains__, missing) if lst.parked else missing)

    def insert(self, key: BlockHash, block: BlockStatus) -> None:
        self._list.order[key] = block

    def insert_many(self, keys: Sequence[BlockHash], blocks: Sequence[BlockStatus]) -> None:
        self._list.order.update(zip(keys, blocks, strict=True))

    def remove(self, key: BlockHash) -> None:
        self._list.pop(key)

    def touch(self, keys: Sequence[BlockHash]) -> None:
        lst = self._list
        order = lst.order
        if not lst.parked:
            consume(map(order.move_to_end, filter(order.__contains__, reversed(keys))))
            return
        move_to_end = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move_to_end(key)
            elif lst.parked:
                lst.move_to_end(key)

    def evict_split(
        self, n: int, protected: Set[BlockHash]
    ) -> tuple[list[BlockHash], list[BlockStatus]] | None:
        if n <= 0:
            return [], []
        if not self._list.has_evictable_parked():
            # the usual case: the n least recent blocks are all evictable
            split = pop_head(self._list.order, n, protected)
            if split is not None:
                return split
        victims = self._evict_scanning(n, protected)
        return None if victims is None else (list(map(first, victims)), list(map(second, victims)))

    def _evict_scanning(self, n: int, protected: Set[BlockHash]) -> Victims | None:
        """Walk from the least recent end, parking the blocks passed over."""
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
        if self._list.parked:
            self._list.mark_evictable(keys)

    def keys(self) -> list[BlockHash]:
        """Stored keys, least recent first."""
        return self._list.keys()
