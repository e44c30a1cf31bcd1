"""Recency lists per class of block, evicted by "last use + a bonus for the class".

The building block of the `reuse` policy (`reuse.py`), used twice there: once for
the real cache and once per shadow cache of its set dueling, so what a shadow
measures is exactly what the cache would do.

Each class (cold, first seen, seen twice, seen more, first seen in a request that
extends a known chain) is one ordered map of key -> the clock at its last use; a
block's score is that clock plus its class's bonus (a multiple of the capacity, in
blocks stored), and eviction takes the lowest score among the classes' least
recent blocks: a k-way merge of k recency lists, O(k) per run of victims, never a
heap. The blocks of one call share a clock tick, split in fractions in the order
they are used (stored ones deepest first, just below the request's hits), so with
equal bonuses the merge is LRU with leaf-first eviction: a request's root outlives
its children whatever classes they are in. (The clock counts blocks stored, so two
touches with no store between them share a tick: across classes their order is
then approximate, within a class it is exact.)

Speed is the point of the layout: the clock lives in the lists themselves and a
block's class is the list that holds it, so storing a block costs two map writes
(index and list) plus a history check, and evicting it two removals plus a history
write; every per-block step runs as a C-level `map`/`filter`. Blocks an eviction
finds pinned or in flight are *parked* (set aside with their class and clock) and
put back at the least recent end of their list by `mark_evictable` once released,
so pinned blocks are passed over once, not by every eviction.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator, Sequence, Set
from itertools import compress, count, filterfalse, islice, repeat

from kvtier.offload._fast import consume, push_head, ref_cnt
from kvtier.offload.backend import BlockStatus
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
_Run = tuple[int, list[BlockHash], list[float]]  # (class, keys, clocks) popped from a list head


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
        self.blocks: dict[BlockHash, BlockStatus] = {}  # every stored block, parked or not
        self.orders: list[OrderedDict[BlockHash, float]] = [OrderedDict() for _ in range(5)]
        self.parked: dict[BlockHash, tuple[int, float]] = {}  # key -> (class, clock)
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

    def class_of(self, key: BlockHash) -> int | None:
        for c, order in enumerate(self.orders):
            if key in order:
                return c
        parked = self.parked.get(key)
        return None if parked is None else parked[0]

    # --- uses ---------------------------------------------------------------

    def touch(self, keys: Sequence[BlockHash]) -> int:
        """Record a use of the present `keys` (last one first; a key listed twice climbs
        once); returns how many listings were present."""
        blocks = self.blocks
        present = list(filter(blocks.__contains__, reversed(keys)))
        hits = len(present)
        if not hits:
            return 0
        if hits > 1 and len(set(present)) != hits:
            present = list(dict.fromkeys(present))
        self._refresh = present
        ticks = count(self.clock, 1.0 / (len(present) + 1))
        if self.parked or min(map(ref_cnt, map(blocks.__getitem__, present))) < 0:
            self._touch_one_by_one(present, ticks)
            return hits
        cold, new, twice, more, chain = self.orders
        # every key climbs a class (MORE stays) and each list takes its keys in the
        # order touched, with increasing ticks: the head of the request ends most recent
        in_more = list(filter(more.__contains__, present))
        if len(in_more) == len(present):  # the usual hit on a hot prefix: all in MORE
            consume(map(more.move_to_end, present))
            more.update(zip(present, ticks, strict=False))
            return hits
        rest = list(filterfalse(twice.__contains__, filterfalse(more.__contains__, present)))
        if not rest:  # to MORE only, some from TWICE
            consume(map(twice.pop, present, repeat(0)))
            consume(map(more.pop, in_more))
            more.update(zip(present, ticks, strict=False))
            return hits
        for order in (new, chain, cold):  # each of `rest` is in exactly one of them
            if order:
                consume(map(order.pop, rest, repeat(0)))
        if len(rest) == len(present):  # to TWICE only
            twice.update(zip(present, ticks, strict=False))
            return hits
        tick = dict(zip(present, ticks, strict=False)).__getitem__  # both: each key keeps its place
        to_more = list(filterfalse(set(rest).__contains__, present))
        consume(map(twice.pop, to_more, repeat(0)))
        consume(map(more.pop, in_more))
        more.update(zip(to_more, map(tick, to_more), strict=True))
        twice.update(zip(rest, map(tick, rest), strict=True))
        return hits

    def _touch_one_by_one(self, present: list[BlockHash], ticks: Iterator[float]) -> None:
        """The general case: parked blocks come back, a store in flight is no new use."""
        orders, parked, blocks = self.orders, self.parked, self.blocks
        for key, tick in zip(present, ticks, strict=False):
            c = self.class_of(key)
            if c is None:  # pragma: no cover - every stored block is in a list or parked
                raise KeyError(f"block {key!r} is stored but in no class")
            if key in parked:
                del parked[key]
            else:
                del orders[c][key]
            new = c if blocks[key].ref_cnt < 0 else _PROMOTED[c]
            orders[new][key] = tick

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
        self.blocks.update(zip(keys, blocks, strict=True))
        orders = self.orders
        order = orders[first_seen]
        clock = self.clock
        # all as first seen (C-level), then the few the history knows move up
        step = 1.0 / (len(keys) + 1)
        order.update(zip(reversed(keys), count(clock - 1 + step, step)))
        new, old = self._hist_new, self._hist_old
        if not (new.keys().isdisjoint(keys) and old.keys().isdisjoint(keys)):
            uses = list(map(new.pop, keys, map(old.pop, keys, repeat(0))))
            returning = zip(reversed(keys), reversed(uses), strict=True)
            for key, used in compress(returning, reversed(uses)):
                orders[_RETURNING[used]][key] = order.pop(key)
            # the request's hits (its parents, in TWICE or MORE like these) were
            # touched before: make them more recent again, so a parent outlives
            # its children (first-seen and cold blocks never share their lists)
            self._refresh_hits()
        if cold_last and keys and keys[-1] in order:
            cold = keys[-1]
            orders[COLD][cold] = order.pop(cold)
        self.clock = clock + len(keys)
        self._refresh = []

    def _refresh_hits(self) -> None:
        for key in self._refresh:
            c = self.class_of(key)
            if c is not None and key not in self.parked:
                self.orders[c].move_to_end(key)

    def remove(self, key: BlockHash) -> BlockStatus | None:
        c = self.class_of(key)
        if c is not None and self.parked.pop(key, None) is None:
            del self.orders[c][key]
        return self.blocks.pop(key, None)

    # --- eviction -----------------------------------------------------------

    def evict(
        self, n: int, protected: Set[BlockHash]
    ) -> tuple[list[BlockHash], list[BlockStatus]] | None:
        """The n lowest-scored evictable, unprotected blocks, removed; or None, no change."""
        if n <= 0:
            return [], []
        if len(self.blocks) - len(self.parked) < n:
            return None
        runs: list[_Run] = []
        keys: list[BlockHash] = []
        victims: list[BlockStatus] = []
        self._pop_heads(n, protected, runs, keys, victims)
        if len(keys) < n and not self._scan(n - len(keys), protected, runs, keys, victims):
            self.blocks.update(zip(keys, victims, strict=True))  # undo, in place
            for c, run, clocks in reversed(runs):
                push_head(self.orders[c], run, clocks)
            return None
        hist = self._hist_new
        for c, run, _ in runs:
            hist.update(zip(run, repeat(_USES[c])))
        if len(hist) >= self._generation:
            self._hist_old, self._hist_new = hist, {}
        return keys, victims

    def _pop_heads(
        self,
        n: int,
        protected: Set[BlockHash],
        runs: list[_Run],
        keys: list[BlockHash],
        victims: list[BlockStatus],
    ) -> None:
        """The usual case: victims from the lists' heads, a run from one list at a time.

        Clocks only grow along a list, so the lowest-scored list keeps the lowest
        score while its next block scores no more than the runner-up's head. Stops
        early at a pinned, in-flight or protected head (then `_scan` goes on).
        """
        orders, bonus, blocks = self.orders, self.bonus, self.blocks
        scores = [
            next(iter(o.values())) + b if o else _NONE for o, b in zip(orders, bonus, strict=True)
        ]
        while len(keys) < n:
            ranked = sorted(scores)
            if ranked[0] == _NONE:
                return
            best = scores.index(ranked[0])  # the first class of equal scores, as in _scan
            order, bonus_best = orders[best], bonus[best]
            run = list(islice(order, n - len(keys)))
            if ranked[1] != _NONE and order[run[-1]] + bonus_best > ranked[1]:
                # keep the blocks scoring <= the runner-up
                clocks = list(islice(order.values(), len(run)))
                del run[max(bisect_right(clocks, ranked[1] - bonus_best), 1) :]
            got = list(map(blocks.pop, run))
            stop = any(map(ref_cnt, got)) or not protected.isdisjoint(run)
            if stop:  # keep the evictable prefix, leave the rest to the scan
                ok = 0
                while got[ok].ref_cnt == 0 and run[ok] not in protected:
                    ok += 1
                blocks.update(zip(run[ok:], got[ok:], strict=True))
                del run[ok:], got[ok:]
            if run:
                runs.append((best, run, list(map(order.pop, run))))
                keys += run
                victims += got
            if stop:
                return
            scores[best] = next(iter(order.values())) + bonus_best if order else _NONE

    def _scan(
        self,
        n: int,
        protected: Set[BlockHash],
        runs: list[_Run],
        keys: list[BlockHash],
        victims: list[BlockStatus],
    ) -> bool:
        """The general case: merge the lists from their heads, passing over pinned,
        in-flight and protected blocks; those pinned or in flight are parked."""
        orders, bonus, blocks = self.orders, self.bonus, self.blocks
        items: list[Iterator[tuple[BlockHash, float]]] = [iter(o.items()) for o in orders]
        heads = [next(it, None) for it in items]
        found: list[tuple[int, BlockHash, float]] = []
        passed: list[tuple[int, BlockHash]] = []
        while len(found) < n:
            best = -1
            best_score = 0.0
            for c, head in enumerate(heads):
                if head is not None and (best < 0 or head[1] + bonus[c] < best_score):
                    best, best_score = c, head[1] + bonus[c]
            if best < 0:
                return False
            key, clock = heads[best]  # type: ignore[misc]
            heads[best] = next(items[best], None)
            if blocks[key].ref_cnt != 0:
                passed.append((best, key))
            elif key not in protected:
                found.append((best, key, clock))
        parked = self.parked
        for c, key in passed:
            parked[key] = (c, orders[c].pop(key))
        for c, key, clock in found:
            del orders[c][key]
            runs.append((c, [key], [clock]))
            keys.append(key)
            victims.append(blocks.pop(key))
        return True

    def mark_evictable(self, keys: Sequence[BlockHash]) -> None:
        """Parked blocks among `keys` that are released go back to the least recent end."""
        parked = self.parked
        if not parked:
            return
        blocks, orders = self.blocks, self.orders
        for key in list(filter(parked.__contains__, keys)):
            if blocks[key].ref_cnt == 0:
                c, clock = parked.pop(key)
                push_head(orders[c], [key], [clock])

    def keys(self) -> list[list[BlockHash]]:
        """Each class's keys, least recent first, parked ones first (for tests)."""
        out: list[list[BlockHash]] = [[] for _ in self.orders]
        for key, (c, _) in self.parked.items():
            out[c].append(key)
        return [parked + list(order) for parked, order in zip(out, self.orders, strict=True)]
