"""Least recently used: evict the least recent evictable, unprotected blocks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence, Set
from itertools import islice

from kvtier.offload._fast import consume, first, ref_cnt, second
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

    def get_iter(self, keys: Iterable[BlockHash]) -> Iterator[BlockStatus | None]:
        lst = self._list
        return map(lst.get if lst.parked else lst.order.get, keys)

    def get_many(self, keys: Sequence[BlockHash]) -> list[BlockStatus | None]:
        lst = self._list
        blocks = list(map(lst.order.get, keys))
        if lst.parked and None in blocks:
            blocks = list(map(lst.get, keys))
        return blocks

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

    def evict(self, n: int, protected: Set[BlockHash]) -> Victims | None:
        if n <= 0:
            return []
        if not self._list.has_evictable_parked():
            return self._evict_from_order(n, protected)
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

    def _evict_from_order(self, n: int, protected: Set[BlockHash]) -> Victims | None:
        """The common case, inlined: no parked block can be a victim."""
        lst = self._list
        order = lst.order
        head = list(islice(order.items(), n))
        if (
            len(head) == n
            and protected.isdisjoint(map(first, head))
            and not any(map(ref_cnt, map(second, head)))
        ):  # the usual case: the n least recent blocks are all evictable
            consume(map(order.__delitem__, map(first, head)))
            return head
        victims: Victims = []
        skipped: list[BlockHash] = []
        for item in order.items():
            if item[1].ref_cnt == 0 and item[0] not in protected:
                victims.append(item)
                if len(victims) == n:
                    break
            else:
                skipped.append(item[0])
        else:
            return None
        for key, _ in victims:
            del order[key]
        if skipped:
            lst.park(skipped)
        return victims

    def mark_evictable(self, keys: Sequence[BlockHash]) -> None:
        lst = self._list
        if lst.parked:
            for key in keys:
                lst.mark_evictable(key)

    def keys(self) -> list[BlockHash]:
        """Stored keys, least recent first."""
        return self._list.keys()
