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
from collections.abc import Iterable, Iterator, Sequence, Set
from itertools import filterfalse, repeat

from kvtier.offload._fast import consume, first, pop_head, push_head, second
from kvtier.offload.backend import BlockStatus
from kvtier.offload.policies.base import CachePolicy, Victims
from kvtier.offload.structures.recency_list import RecencyList
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

    # vLLM's names for the two lists (its tests read `len(policy.t1)`, `h in policy.t2`)
    @property
    def t1(self) -> RecencyList:
        return self._t1

    @property
    def t2(self) -> RecencyList:
        return self._t2

    def stored_keys(self) -> list[BlockHash]:
        t1, t2 = self._t1, self._t2
        return [*t1.order, *t1.parked, *t2.order, *t2.parked]

    def get(self, key: BlockHash) -> BlockStatus | None:
        block = self._t1.get(key)
        return self._t2.get(key) if block is None else block

    def get_iter(self, keys: Iterable[BlockHash]) -> Iterator[BlockStatus | None]:
        keys = keys if isinstance(keys, list) else list(keys)
        t1, t2 = self._t1, self._t2
        # T1's answer, defaulting to T2's: C-level lookups, no Python call per key
        if t1.parked or t2.parked:
            parked = map(t1.parked.get, keys, map(t2.parked.get, keys))
            return map(t1.order.get, keys, map(t2.order.get, keys, parked))
        return map(t1.order.get, keys, map(t2.order.get, keys))

    def get_many(self, keys: Sequence[BlockHash]) -> list[BlockStatus | None]:
        t1, t2 = self._t1, self._t2
        if keys and not (t1.parked or t2.parked):
            # a call's blocks usually share a list (just stored: T1; loaded: T2):
            # guess it from the first key, then one lookup per key
            if keys[0] in t1.order:
                order, other = t1.order, t2.order
            else:
                order, other = t2.order, t1.order
            blocks = list(map(order.get, keys))
            if None in blocks:  # a mixed call: the other list fills the gaps
                blocks = list(map(other.get, keys, blocks))
            return blocks
        return list(self.get_iter(keys))

    def absent(self, keys: Sequence[BlockHash]) -> list[BlockHash]:
        missing = filterfalse(self._t2.order.__contains__, keys)
        missing = filterfalse(self._t1.order.__contains__, missing)
        for lst in (self._t1, self._t2):
            if lst.parked:
                missing = filterfalse(lst.parked.__contains__, missing)
        return list(missing)

    def insert(self, key: BlockHash, block: BlockStatus) -> None:
        self._t1.order[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def insert_many(self, keys: Sequence[BlockHash], blocks: Sequence[BlockStatus]) -> None:
        self._t1.order.update(zip(keys, blocks, strict=True))
        for ghost in (self.b1, self.b2):
            if ghost:
                consume(map(ghost.__delitem__, filter(ghost.__contains__, keys)))

    def remove(self, key: BlockHash) -> None:
        if self._t1.pop(key) is None:
            self._t2.pop(key)

    def touch(self, keys: Sequence[BlockHash]) -> None:
        t1, t2 = self._t1, self._t2
        t1_order, t2_order = t1.order, t2.order
        b1, b2 = self.b1, self.b2
        any_parked = bool(t1.parked or t2.parked)
        for key in reversed(keys):
            if key in t1_order:
                block = t1_order.pop(key)
                # a store in flight is not a second use: refresh it in T1
                (t1_order if block.ref_cnt < 0 else t2_order)[key] = block
            elif key in t2_order:
                t2_order.move_to_end(key)
            elif any_parked and self._touch_parked(key):
                pass
            elif key in b1:
                delta = max(1, len(b2) / len(b1))
                self.target_t1_size = min(self.target_t1_size + delta, self.cache_capacity)
                b1.move_to_end(key)
            elif key in b2:
                delta = max(1, len(b1) / len(b2))
                self.target_t1_size = max(self.target_t1_size - delta, 0)
                b2.move_to_end(key)

    def _touch_parked(self, key: BlockHash) -> bool:
        """`touch` for a block parked in T1 or T2; False if it is in neither."""
        block = self._t1.pop(key) if key in self._t1.parked else None
        if block is not None:
            (self._t1.order if block.ref_cnt < 0 else self._t2.order)[key] = block
            return True
        return self._t2.move_to_end(key) if key in self._t2.parked else False

    def evict_split(
        self, n: int, protected: Set[BlockHash]
    ) -> tuple[list[BlockHash], list[BlockStatus]] | None:
        if n <= 0:
            return [], []
        t1, t2 = self._t1, self._t2
        if t1.has_evictable_parked() or t2.has_evictable_parked():
            victims = self._evict_scanning(n, protected)
            return (
                None if victims is None else (list(map(first, victims)), list(map(second, victims)))
            )
        # the usual case: the victims are T1's k least recent blocks (while T1, less the
        # victims already chosen, is at least the target), then T2's; all evictable
        target = int(self.target_t1_size)
        size1 = len(t1)
        k = min(n, size1, max(0, size1 - target + 1))
        split = self._evict_heads(k, n - k, protected)
        return self._evict_from_orders(n, protected) if split is None else split

    def _evict_heads(
        self, k: int, m: int, protected: Set[BlockHash]
    ) -> tuple[list[BlockHash], list[BlockStatus]] | None:
        """T1's k then T2's m least recent blocks if all are evictable (else None, no change)."""
        t1_order, t2_order = self._t1.order, self._t2.order
        split1 = pop_head(t1_order, k, protected) if k else None
        if k and split1 is None:
            return None
        split2 = pop_head(t2_order, m, protected) if m else None
        if m and split2 is None:
            if split1 is not None:
                push_head(t1_order, *split1)
            return None
        if split1 is not None:
            self._to_ghosts(split1[0], None, self.b1)
        if split2 is not None:
            self._to_ghosts(split2[0], None, self.b2)
        if split1 is None or split2 is None:
            return split1 or split2 or ([], [])
        return split1[0] + split2[0], split1[1] + split2[1]

    def _evict_scanning(self, n: int, protected: Set[BlockHash]) -> Victims | None:
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
        self._to_ghosts([key for key, _, was_t1 in chosen if was_t1], None, self.b1)
        self._to_ghosts([key for key, _, was_t1 in chosen if not was_t1], None, self.b2)
        return [(key, block) for key, block, _ in chosen]

    def _evict_from_orders(
        self, n: int, protected: Set[BlockHash]
    ) -> tuple[list[BlockHash], list[BlockStatus]] | None:
        """`_evict_scanning` inlined for the common case: no parked block can be a victim."""
        t1, t2 = self._t1, self._t2
        items1, items2 = iter(t1.order.items()), iter(t2.order.items())
        skipped1: list[BlockHash] = []
        skipped2: list[BlockHash] = []
        victims: Victims = []
        from_t1: list[BlockHash] = []
        from_t2: list[BlockHash] = []
        virtual_t1_size = len(t1)
        target = int(self.target_t1_size)
        t1_exhausted = False
        for _ in range(n):
            if virtual_t1_size >= target and not t1_exhausted:
                for item in items1:
                    if item[1].ref_cnt == 0 and item[0] not in protected:
                        victims.append(item)
                        from_t1.append(item[0])
                        break
                    skipped1.append(item[0])
                else:
                    t1_exhausted = True
                if not t1_exhausted:
                    virtual_t1_size -= 1
                    continue
            for item in items2:
                if item[1].ref_cnt == 0 and item[0] not in protected:
                    victims.append(item)
                    from_t2.append(item[0])
                    break
                skipped2.append(item[0])
            else:
                return None
        self._to_ghosts(from_t1, t1.order, self.b1)
        self._to_ghosts(from_t2, t2.order, self.b2)
        if skipped1:
            t1.park(skipped1)
        if skipped2:
            t2.park(skipped2)
        return list(map(first, victims)), list(map(second, victims))

    def _to_ghosts(
        self,
        keys: list[BlockHash],
        order: OrderedDict[BlockHash, BlockStatus] | None,
        ghost: OrderedDict[BlockHash, None],
    ) -> None:
        """Move victims (from `order`, unless already removed) to a ghost list; trim it."""
        if order is not None:
            consume(map(order.__delitem__, keys))
        ghost.update(zip(keys, repeat(None)))  # victims are never ghosts already: appended
        excess = len(ghost) - self.cache_capacity
        if excess > 0:
            consume(map(ghost.popitem, repeat(False, excess)))

    def mark_evictable(self, keys: Sequence[BlockHash]) -> None:
        if self._t1.parked:
            self._t1.mark_evictable(keys)
        if self._t2.parked:
            self._t2.mark_evictable(keys)

    def ghost_sizes(self) -> tuple[int, ...]:
        return (len(self.b1), len(self.b2))

    def keys(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """T1 and T2 keys, least recent first."""
        return self._t1.keys(), self._t2.keys()
