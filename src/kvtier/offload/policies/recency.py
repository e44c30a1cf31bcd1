"""A recency list whose eviction scan never walks over pinned or in-flight blocks twice.

vLLM's policies scan an ordered map from the least-recent end and skip blocks that
are pinned (being loaded) or in flight (being stored), so with many such blocks in
front every eviction pays for all of them again. Here a block the scan passes over
is *parked*: moved out of `order` into `parked`, tagged with an increasing sequence
number. Because the scan only ever parks from the least-recent end, every parked
block is older than every block still in `order`, and parked blocks are ordered
among themselves by their sequence number. So the full recency order is always
"parked by sequence, then `order`", and the victims are exactly vLLM's.

Parked blocks that are evictable wait in a heap keyed by sequence number; a block
that is touched leaves `parked` for the most-recent end of `order`. Heap entries are
checked lazily (still parked with that sequence, ref count 0) and compacted when
stale ones pile up, so every operation stays O(log n) amortized and an eviction
costs the same whether 0% or 90% of the blocks are pinned.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Set

from kvtier.offload.backend import BlockStatus
from kvtier.types import BlockHash

_HeapEntry = tuple[int, BlockHash]


class RecencyList:
    __slots__ = ("_heap", "_seq", "order", "parked")

    def __init__(self) -> None:
        # least recent first; may still hold non-evictable blocks not yet scanned
        self.order: OrderedDict[BlockHash, BlockStatus] = OrderedDict()
        # key -> (sequence number, block); all older than anything in `order`
        self.parked: dict[BlockHash, tuple[int, BlockStatus]] = {}
        self._heap: list[_HeapEntry] = []  # parked blocks that may be evictable
        self._seq = 0

    def __len__(self) -> int:
        return len(self.order) + len(self.parked)

    def __contains__(self, key: object) -> bool:
        return key in self.order or key in self.parked

    def get(self, key: BlockHash) -> BlockStatus | None:
        block = self.order.get(key)
        if block is None and self.parked:
            entry = self.parked.get(key)
            if entry is not None:
                return entry[1]
        return block

    def pop(self, key: BlockHash) -> BlockStatus | None:
        block = self.order.pop(key, None)
        if block is None and self.parked:
            entry = self.parked.pop(key, None)
            if entry is not None:
                self._drop_heap_if_unparked()
                return entry[1]
        return block

    def move_to_end(self, key: BlockHash) -> bool:
        """Make `key` the most recent; False if absent."""
        if key in self.order:
            self.order.move_to_end(key)
            return True
        entry = self.parked.pop(key, None) if self.parked else None
        if entry is None:
            return False
        self.order[key] = entry[1]
        self._drop_heap_if_unparked()
        return True

    def mark_evictable(self, key: BlockHash) -> None:
        entry = self.parked.get(key)
        if entry is not None and entry[1].ref_cnt == 0:
            heapq.heappush(self._heap, (entry[0], key))
            if len(self._heap) > 2 * len(self.parked) + 64:
                self._rebuild_heap()

    def has_evictable_parked(self) -> bool:
        """Whether the heap may hold a victim (False: the scan can start at `order`)."""
        return bool(self._heap)

    def keys(self) -> list[BlockHash]:
        """All keys, least recent first (for tests and debugging; O(n log n))."""
        parked = sorted(self.parked.items(), key=lambda item: item[1][0])
        return [key for key, _ in parked] + list(self.order)

    def scan(self, protected: Set[BlockHash]) -> RecencyScan:
        return RecencyScan(self, protected)

    def park(self, keys: list[BlockHash]) -> None:
        """Move keys (a least-recent prefix of `order`, in order) to `parked`."""
        order, parked, heap = self.order, self.parked, self._heap
        seq = self._seq
        for key in keys:
            block = order.pop(key)
            seq += 1
            parked[key] = (seq, block)
            if block.ref_cnt == 0:
                heap.append((seq, key))  # increasing seq: still a valid heap
        self._seq = seq

    def _drop_heap_if_unparked(self) -> None:
        if not self.parked:
            self._heap.clear()

    def _rebuild_heap(self) -> None:
        self._heap = [(seq, key) for key, (seq, block) in self.parked.items() if block.ref_cnt == 0]
        heapq.heapify(self._heap)


class RecencyScan:
    """One eviction's walk over a `RecencyList`, least recent first.

    `next()` yields evictable, unprotected blocks without changing the list's
    order; `commit()` removes everything yielded, `abort()` leaves no trace.
    """

    __slots__ = ("_items", "_lst", "_popped", "_protected", "_skipped", "_taken", "_taken_parked")

    def __init__(self, lst: RecencyList, protected: Set[BlockHash]) -> None:
        self._lst = lst
        self._protected = protected
        self._items: Iterator[tuple[BlockHash, BlockStatus]] = iter(lst.order.items())
        self._popped: list[_HeapEntry] = []  # valid heap entries taken out
        self._skipped: list[BlockHash] = []  # keys of `order` passed over
        self._taken: list[BlockHash] = []  # yielded from `order`
        self._taken_parked: set[BlockHash] = set()  # yielded from `parked`

    def next(self) -> tuple[BlockHash, BlockStatus] | None:
        lst, protected = self._lst, self._protected
        heap, parked = lst._heap, lst.parked
        while heap:
            entry = heapq.heappop(heap)
            parked_entry = parked.get(entry[1])
            if parked_entry is None or parked_entry[0] != entry[0]:
                continue  # stale: touched or removed since
            block = parked_entry[1]
            if block.ref_cnt != 0:
                continue  # pinned again; re-pushed when it drops to 0
            self._popped.append(entry)
            key = entry[1]
            if key in protected or key in self._taken_parked:
                continue  # protected, or a duplicate entry of a block already yielded
            self._taken_parked.add(key)
            return key, block
        for key, block in self._items:
            if block.ref_cnt == 0 and key not in protected:
                self._taken.append(key)
                return key, block
            self._skipped.append(key)
        return None

    def commit(self) -> None:
        lst = self._lst
        order, parked = lst.order, lst.parked
        for key in self._taken:
            del order[key]
        for key in self._taken_parked:
            del parked[key]
        self._restore_heap()
        if self._skipped:
            lst.park(self._skipped)
        lst._drop_heap_if_unparked()

    def abort(self) -> None:
        self._taken.clear()
        self._taken_parked.clear()
        self._restore_heap()

    def _restore_heap(self) -> None:
        heap, parked = self._lst._heap, self._lst.parked
        seen: set[_HeapEntry] = set()
        for entry in self._popped:
            parked_entry = parked.get(entry[1])
            if entry not in seen and parked_entry is not None and parked_entry[0] == entry[0]:
                seen.add(entry)
                heapq.heappush(heap, entry)
