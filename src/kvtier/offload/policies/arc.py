"""Adaptive Replacement Cache (Megiddo and Modha, FAST'03), as vLLM adapts it.

T1 holds blocks seen once, T2 blocks seen again; B1 and B2 remember the hashes
recently evicted from each. A touch of a B1 ghost means T1 was too small, so its
target size p grows (by the ghost-list ratio); a B2 ghost shrinks it. Eviction
takes from T1 while T1 (minus the victims already chosen) is at least int(p).

Two vLLM decisions kept on purpose: touching a not-ready T1 block (its store is in
flight) only refreshes it in T1, since a store is not a second use; and when T1 is
below target and T2 has no evictable block, the eviction fails even if T1 has one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence, Set

from kvtier.offload.backend import BlockStatus
from kvtier.offload.policies.base import CachePolicy, Victims
from kvtier.offload.policies.recency import RecencyList
from kvtier.types import BlockHash


class ARCCachePolicy(CachePolicy):
    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.target_t1_size: float = 0.0
        self._t1 = RecencyList()
        self._t2 = RecencyList()
        self.b1: OrderedDict[BlockHash, None] = OrderedDict()
        self.b2: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def get(self, key: BlockHash) -> BlockStatus | None:
        block = self._t1.get(key)
        return self._t2.get(key) if block is None else block

    def insert(self, key: BlockHash, block: BlockStatus) -> None:
        self._t1.order[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def insert_many(self, keys: Sequence[BlockHash], blocks: Sequence[BlockStatus]) -> None:
        t1, b1, b2 = self._t1.order, self.b1, self.b2
        for key, block in zip(keys, blocks, strict=True):
            t1[key] = block
            if b1:
                b1.pop(key, None)
            if b2:
                b2.pop(key, None)

    def remove(self, key: BlockHash) -> None:
        if self._t1.pop(key) is None:
            self._t2.pop(key)

    def touch(self, keys: Sequence[BlockHash]) -> None:
        t1, t2 = self._t1, self._t2
        t1_order, t2_order = t1.order, t2.order
        b1, b2 = self.b1, self.b2
        for key in reversed(keys):
            block = t1_order.pop(key, None)
            if block is None and t1.parked:
                block = t1.pop(key)
            if block is not None:
                # a store in flight is not a second use: refresh it in T1
                (t1_order if block.ref_cnt < 0 else t2_order)[key] = block
            elif key in t2_order:
                t2_order.move_to_end(key)
            elif t2.parked and t2.move_to_end(key):
                pass
            elif key in b1:
                delta = max(1, len(b2) / len(b1))
                self.target_t1_size = min(self.target_t1_size + delta, self.cache_capacity)
                b1.move_to_end(key)
            elif key in b2:
                delta = max(1, len(b1) / len(b2))
                self.target_t1_size = max(self.target_t1_size - delta, 0)
                b2.move_to_end(key)

    def evict(self, n: int, protected: Set[BlockHash]) -> Victims | None:
        if n <= 0:
            return []
        scan1, scan2 = self._t1.scan(protected), self._t2.scan(protected)
        virtual_t1_size = len(self._t1)
        target = int(self.target_t1_size)
        chosen: list[tuple[BlockHash, BlockStatus, bool]] = []
        while len(chosen) < n:
            if virtual_t1_size >= target:
                victim = scan1.next()
                if victim is not None:
                    virtual_t1_size -= 1
                    chosen.append((victim[0], victim[1], True))
                    continue
            victim = scan2.next()
            if victim is None:
                scan1.abort()
                scan2.abort()
                return None
            chosen.append((victim[0], victim[1], False))
        scan1.commit()
        scan2.commit()
        return self._to_ghosts(chosen)

    def _to_ghosts(self, chosen: list[tuple[BlockHash, BlockStatus, bool]]) -> Victims:
        b1, b2 = self.b1, self.b2
        for key, _, from_t1 in chosen:
            (b1 if from_t1 else b2)[key] = None
        for ghost in (b1, b2):
            for _ in range(len(ghost) - self.cache_capacity):
                ghost.popitem(last=False)
        return [(key, block) for key, block, _ in chosen]

    def mark_evictable(self, keys: Sequence[BlockHash]) -> None:
        for lst in (self._t1, self._t2):
            if lst.parked:
                for key in keys:
                    lst.mark_evictable(key)

    def ghost_sizes(self) -> tuple[int, ...]:
        return (len(self.b1), len(self.b2))

    def keys(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """T1 and T2 keys, least recent first."""
        return self._t1.keys(), self._t2.keys()
