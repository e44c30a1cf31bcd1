"""Recency lists per class of block, evicted by "last use + a bonus for the class".

The building block of the `reuse` policy (`reuse.py`), used twice there: once for
the real cache and once per shadow cache of its set dueling, so what a shadow
measures is exactly what the cache would do.

Each class (cold, first seen, seen twice, seen more, first seen in a request that
extends a known chain) is one `RecencyList`; a block's score is the clock at its
last use plus its class's bonus (a multiple of the capacity, in blocks stored),
and eviction takes the lowest score among the classes' least recent evictable
blocks: a k-way merge of k recency lists, so an eviction costs O(k) per victim
and never a heap. Pinned and in-flight blocks are parked by each list as in LRU
and ARC, so pinned blocks cost the same here as there.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence, Set
from itertools import compress, filterfalse, islice, repeat

from kvtier.offload._fast import consume, push_head, ref_cnt
from kvtier.offload.backend import BlockStatus
from kvtier.offload.policies.recency import RecencyList, RecencyScan
from kvtier.types import BlockHash

# Block classes. A block enters as COLD, NEW or NEW_IN_CHAIN (by what its request
# says) or TWICE/MORE (when remembered in the history), and climbs on every use.
COLD, NEW, TWICE, MORE, NEW_IN_CHAIN = range(5)
NUM_CLASSES = 5
_PROMOTED = (TWICE, TWICE, MORE, MORE, TWICE)  # the class after a use
_USES = (1, 1, 2, 3, 1)  # uses a class stands for (capped), kept in the history
_RETURNING = (NEW, TWICE, MORE, MORE)  # the class of a block stored again, by its past uses

Weights = tuple[float, float, float, float, float]
_NONE = float("inf")  # the score of an empty list


class _Scan(RecencyScan):
    """A `RecencyScan` that can give back the block it yielded last."""

    __slots__ = ()

    def give_back(self, key: BlockHash) -> None:
        if key in self._taken_parked:
            self._taken_parked.discard(key)  # its heap entry is restored on commit
        else:
            self._taken.pop()


class ScoredLists:
    """The blocks of one cache (or shadow): per-class recency lists and a history.

    The history remembers, for a few capacities' worth of evicted blocks, how
    often each was used, so a block stored again resumes its class instead of
    starting over as NEW (the doorkeeper of TinyLFU, bounded like ARC's ghosts).
    It is two plain dicts, the newer generation replacing the older when full:
    an OrderedDict trimmed one key at a time costs several times more per block.
    """

    def __init__(self, capacity: int, weights: Weights, history_factor: float) -> None:
        self.capacity = capacity
        self.blocks: dict[BlockHash, BlockStatus] = {}
        self.cls: dict[BlockHash, int] = {}
        self.time: dict[BlockHash, int] = {}
        self.lists = [RecencyList() for _ in range(NUM_CLASSES)]
        self._orders = [lst.order for lst in self.lists]  # the same dicts, for eviction
        self._parked = [lst.parked for lst in self.lists]  # the same dicts, for `any`
        self._hist_new: dict[BlockHash, int] = {}
        self._hist_old: dict[BlockHash, int] = {}
        self._generation = max(1, int(history_factor * capacity) // 2)
        self.clock = 0
        self._refresh: list[BlockHash] = []  # the last touch's present keys, as touched
        self.bonus: list[float] = []
        self.set_weights(weights)

    def set_weights(self, weights: Weights) -> None:
        self.bonus = [w * max(1, self.capacity) for w in weights]

    def seen(self, key: BlockHash) -> bool:
        return key in self.blocks or key in self._hist_new or key in self._hist_old

    def touch(self, keys: Sequence[BlockHash]) -> int:
        """Record a use of the present `keys` (last one first); returns how many were present."""
        blocks = self.blocks
        present = list(filter(blocks.__contains__, reversed(keys)))
        if not present:
            return 0
        self._refresh = present
        self.time.update(zip(present, repeat(self.clock)))
        lists = self.lists
        if any(self._parked):
            self._promote(present, lambda c, key: lists[c].move_to_end(key), lists)
            return len(present)
        more = lists[MORE].order
        # blocks already in MORE only move; the others climb a class (promoted first,
        # so a MORE parent touched with a climbing child still ends the more recent)
        self._promote(list(filterfalse(more.__contains__, present)), None, lists)
        consume(map(more.move_to_end, filter(more.__contains__, present)))
        return len(present)

    def _promote(
        self,
        keys: list[BlockHash],
        move: Callable[[int, BlockHash], object] | None,
        lists: list[RecencyList],
    ) -> None:
        """Move each key up a class (MORE stays), most recent last; `move` for parked lists."""
        blocks, cls = self.blocks, self.cls
        for key in keys:
            c = cls[key]
            block = blocks[key]
            new = c if block.ref_cnt < 0 else _PROMOTED[c]  # a store in flight: no new use
            if new == c:
                if move is None:
                    lists[c].order.move_to_end(key)
                else:
                    move(c, key)
            else:
                if move is None:
                    del lists[c].order[key]
                else:
                    lists[c].pop(key)
                lists[new].order[key] = block
                cls[key] = new

    def insert(
        self,
        keys: Sequence[BlockHash],
        blocks: Sequence[BlockStatus],
        first_seen: int,
        cold_last: bool,
    ) -> None:
        """Add absent blocks, deepest first (so a parent is more recent than its children).

        `first_seen`: the class of blocks the history does not know; `cold_last`:
        the last key, if first seen, is COLD (a request's last block, when those
        are seldom reused).
        """
        index, cls, lists = self.blocks, self.cls, self.lists
        index.update(zip(keys, blocks, strict=True))
        self.time.update(zip(keys, repeat(self.clock)))
        # all as first seen (C-level), then the few the history knows move up
        order = lists[first_seen].order
        order.update(zip(reversed(keys), reversed(blocks), strict=True))
        cls.update(zip(keys, repeat(first_seen)))
        new, old = self._hist_new, self._hist_old
        if new or old:
            uses = list(map(new.pop, keys, map(old.pop, keys, repeat(0))))
            if any(uses):
                returning = zip(reversed(keys), reversed(uses), strict=True)
                for key, used in compress(returning, reversed(uses)):
                    c = _RETURNING[used]
                    lists[c].order[key] = order.pop(key)
                    cls[key] = c
                # the request's hits (its parents, in TWICE or MORE like these) were
                # touched before: make them more recent again, so a parent outlives
                # its children (first-seen and cold blocks never share their lists)
                self._refresh_hits()
        if cold_last and keys and cls[keys[-1]] == first_seen:
            cold = keys[-1]
            lists[COLD].order[cold] = order.pop(cold)
            cls[cold] = COLD
        self.clock += len(keys)
        self._refresh = []

    def _refresh_hits(self) -> None:
        cls, lists = self.cls, self.lists
        for key in self._refresh:
            c = cls.get(key)
            if c is not None:
                lst = lists[c]
                if key in lst.order:
                    lst.order.move_to_end(key)
                else:
                    lst.move_to_end(key)

    def remove(self, key: BlockHash) -> BlockStatus | None:
        block = self.blocks.pop(key, None)
        if block is not None:
            self.lists[self.cls.pop(key)].pop(key)
            del self.time[key]
        return block

    def evict(
        self, n: int, protected: Set[BlockHash]
    ) -> tuple[list[BlockHash], list[BlockStatus]] | None:
        """The n lowest-scored evictable, unprotected blocks, removed; or None, no change."""
        if n <= 0:
            return [], []
        if len(self.blocks) < n:
            return None
        keys: list[BlockHash] = []
        victims: list[BlockStatus] = []
        classes: list[int] = []
        if not any(self._parked) or not any(map(RecencyList.has_evictable_parked, self.lists)):
            self._pop_heads(n, protected, keys, victims, classes)
        if len(keys) < n and not self._scan(n, protected, keys, victims, classes):
            for c, key, block in zip(
                reversed(classes), reversed(keys), reversed(victims), strict=True
            ):
                push_head(self.lists[c].order, [key], [block])  # undo, in place
            return None
        self._forget(keys, classes)
        return keys, victims

    def _pop_heads(
        self,
        n: int,
        protected: Set[BlockHash],
        keys: list[BlockHash],
        victims: list[BlockStatus],
        classes: list[int],
    ) -> None:
        """The usual case: victims from the lists' heads, a run from one list at a time.

        Times only grow along a list, so the lowest-scored list keeps the lowest
        score while its next block scores no more than the runner-up's head. Stops
        early at a pinned, in-flight or protected head (then `_scan` goes on).
        """
        orders = self._orders
        time, bonus = self.time, self.bonus
        scores = [
            time[next(iter(o))] + b if o else _NONE for o, b in zip(orders, bonus, strict=True)
        ]
        while len(keys) < n:
            ranked = sorted(scores)
            if ranked[0] == _NONE:
                return
            best = scores.index(ranked[0])  # the first class of equal scores, as in _scan
            order, bonus_best, b = orders[best], bonus[best], n - len(keys)
            run = list(islice(order, b))
            if ranked[1] != _NONE and time[run[-1]] + bonus_best > ranked[1]:
                # times only grow along a list: keep the blocks scoring <= the runner-up
                cut = bisect_right(run, ranked[1] - bonus_best, key=time.__getitem__)
                del run[max(cut, 1) :]
            blocks = list(map(order.pop, run))
            if any(map(ref_cnt, blocks)) or not protected.isdisjoint(run):
                ok = 0
                while blocks[ok].ref_cnt == 0 and run[ok] not in protected:
                    ok += 1
                push_head(order, run[ok:], blocks[ok:])
                keys += run[:ok]
                victims += blocks[:ok]
                classes += [best] * ok
                return
            keys += run
            victims += blocks
            classes += [best] * len(run)
            scores[best] = time[next(iter(order))] + bonus_best if order else _NONE

    def _scan(
        self,
        n: int,
        protected: Set[BlockHash],
        keys: list[BlockHash],
        victims: list[BlockStatus],
        classes: list[int],
    ) -> bool:
        """The general case: merge the lists' scans (which park what they pass over)."""
        scans = [_Scan(lst, protected) if len(lst) else None for lst in self.lists]
        heads = [None if s is None else s.next() for s in scans]
        start = len(keys)
        time, bonus = self.time, self.bonus
        while len(keys) < n:
            best = -1
            best_score = 0.0
            for c, head in enumerate(heads):
                if head is not None:
                    score = time[head[0]] + bonus[c]
                    if best < 0 or score < best_score:
                        best, best_score = c, score
            if best < 0:
                for scan in scans:
                    if scan is not None:
                        scan.abort()
                del keys[start:], victims[start:], classes[start:]  # only those popped before
                return False
            key, block = heads[best]  # type: ignore[misc]
            keys.append(key)
            victims.append(block)
            classes.append(best)
            heads[best] = scans[best].next()  # type: ignore[union-attr]
        for scan, head in zip(scans, heads, strict=True):
            if scan is not None:
                if head is not None:
                    scan.give_back(head[0])
                scan.commit()
        return True

    def _forget(self, keys: list[BlockHash], classes: list[int]) -> None:
        """Drop victims from the indexes and remember their uses in the history."""
        consume(map(self.blocks.__delitem__, keys))
        consume(map(self.cls.__delitem__, keys))
        consume(map(self.time.__delitem__, keys))
        new = self._hist_new
        new.update(zip(keys, map(_USES.__getitem__, classes), strict=True))
        if len(new) >= self._generation:
            self._hist_old, self._hist_new = new, {}

    def mark_evictable(self, keys: Sequence[BlockHash]) -> None:
        for lst in self.lists:
            if lst.parked:
                lst.mark_evictable(keys)

    def keys(self) -> list[list[BlockHash]]:
        """Each class's keys, least recent first (for tests)."""
        return [lst.keys() for lst in self.lists]
