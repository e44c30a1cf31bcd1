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
from collections.abc import Iterable, Iterator, Set

from kvtier.offload.backend import BlockStatus
from kvtier.types import BlockHash

_HeapEntry = tuple[int, BlockHash]


class RecencyList:
    __slots__ = ("_heap", "_parked_seq", "_seq", "order", "parked")

    def __init__(self) -> None:
        # least recent first; may still hold non-evictable blocks not yet scanned
        self.order: OrderedDict[BlockHash, BlockStatus] = OrderedDict()
        # parked key -> block (a plain map, so lookups stay C-level), and its
        # sequence number; all parked blocks are older than anything in `order`
        self.parked: dict[BlockHash, BlockStatus] = {}
        self._parked_seq: dict[BlockHash, int] = {}
        self._heap: list[_HeapEntry] = []  # parked blocks that may be evictable
        self._seq = 0

    def __len__(self) -> int:
        return len(self.order) + len(self.parked)

    def __contains__(self, key: object) -> bool:
        return key in self.order or key in self.parked

    def __iter__(self) -> Iterator[BlockHash]:
        """The keys, least recent first (what iterating vLLM's OrderedDict gives)."""
        return iter(self.keys())

    def get(self, key: BlockHash) -> BlockStatus | None:
        block = self.order.get(key)
        return self.parked.get(key) if block is None and self.parked else block

    def pop(self, key: BlockHash) -> BlockStatus | None:
        block = self.order.pop(key, None)
        if block is None and self.parked:
            block = self.parked.pop(key, None)
            if block is not None:
                del self._parked_seq[key]
                self._drop_heap_if_unparked()
        return block

    def move_to_end(self, key: BlockHash) -> bool:
        """Make `key` the most recent; False if absent."""
        if key in self.order:
            self.order.move_to_end(key)
            return True
        block = self.pop(key) if self.parked else None
        if block is None:
            return False
        self.order[key] = block
        return True

    def mark_evictable(self, keys: Iterable[BlockHash]) -> None:
        """Queue the parked ones among `keys` that are evictable (ref count 0) now."""
        parked = self.parked
        for key in filter(parked.__contains__, keys):  # C-level: most keys are not parked
            if parked[key].ref_cnt == 0:
                heapq.heappush(self._heap, (self._parked_seq[key], key))
        if len(self._heap) > 2 * len(parked) + 64:
            self._rebuild_heap()

    def has_evictable_parked(self) -> bool:
        """Whether the heap may hold a victim (False: the scan can start at `order`)."""
        return bool(self._heap)

    def keys(self) -> list[BlockHash]:
        """All keys, least recent first (for tests and debugging; O(n log n))."""
        return sorted(self.parked, key=self._parked_seq.__getitem__) + list(self.order)

    def scan(self, protected: Set[BlockHash]) -> RecencyScan:
        return RecencyScan(self, protected)

    def park(self, keys: list[BlockHash]) -> None:
        """Move keys (a least-recent prefix of `order`, in order) to `parked`."""
        order, parked, parked_seq, heap = self.order, self.parked, self._parked_seq, self._heap
        seq = self._seq
        for key in keys:
            block = order.pop(key)
            seq += 1
            parked[key] = block
            parked_seq[key] = seq
            if block.ref_cnt == 0:
                heap.append((seq, key))  # the largest seq so far: still a valid heap
        self._seq = seq

    def is_parked_as(self, entry: _HeapEntry) -> bool:
        """Whether a heap entry still describes a parked block (not touched or removed since)."""
        return self._parked_seq.get(entry[1]) == entry[0]

    def unpark_victim(self, key: BlockHash) -> None:
        del self.parked[key]
        del self._parked_seq[key]

    def _drop_heap_if_unparked(self) -> None:
        if not self.parked:
            self._heap.clear()

    def _rebuild_heap(self) -> None:
        seqs = self._parked_seq
        self._heap = [(seqs[key], key) for key, block in self.parked.items() if block.ref_cnt == 0]
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
            if not lst.is_parked_as(entry):
                continue  # stale: touched or removed since
            key = entry[1]
            block = parked[key]
            if block.ref_cnt != 0:
                continue  # pinned again; re-pushed when it drops to 0
            self._popped.append(entry)
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
        order = lst.order
        for key in self._taken:
            del order[key]
        for key in self._taken_parked:
            lst.unpark_victim(key)
        self._restore_heap()
        if self._skipped:
            lst.park(self._skipped)
        lst._drop_heap_if_unparked()

    def abort(self) -> None:
        self._taken.clear()
        self._taken_parked.clear()
        self._restore_heap()

    def _restore_heap(self) -> None:
        lst = self._lst
        seen: set[_HeapEntry] = set()
        for entry in self._popped:
            if entry not in seen and lst.is_parked_as(entry):
                seen.add(entry)
                heapq.heappush(lst._heap, entry)
