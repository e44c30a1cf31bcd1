"""The baseline: vLLM 0.19's CPU offloading manager with its LRU and ARC policies.

A behaviour-faithful port (not an import: the benchmarks must run without vLLM)
of `vllm/v1/kv_offload/cpu_manager.py`: a ctypes block status, ordered maps scanned
from the least-recent end on every eviction (skipping pinned and in-flight blocks
each time), ARC rescanning from the start for every victim, asserts for caller
mistakes. kvtier's managers must make exactly the same decisions, faster; the
differential tests and `bench_offload` compare against this module.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kvtier.offload.abstract import OffloadingEvent, PrepareStoreOutput
from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.types import BlockHash


class RefBlockStatus(ctypes.Structure):
    _fields_ = [("ref_cnt", ctypes.c_int32), ("block_id", ctypes.c_int64)]

    def __init__(self, block_id: int) -> None:
        super().__init__()
        self.ref_cnt = -1  # not ready until its store completes
        self.block_id = block_id

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


Victims = list[tuple[BlockHash, RefBlockStatus]]


class RefLRUPolicy:
    def __init__(self, cache_capacity: int) -> None:
        self.blocks: OrderedDict[BlockHash, RefBlockStatus] = OrderedDict()

    def get(self, key: BlockHash) -> RefBlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: BlockHash, block: RefBlockStatus) -> None:
        self.blocks[key] = block

    def remove(self, key: BlockHash) -> None:
        del self.blocks[key]

    def touch(self, keys: Iterable[BlockHash]) -> None:
        for key in reversed(list(keys)):
            if self.blocks.get(key):
                self.blocks.move_to_end(key)

    def evict(self, n: int, protected: set[BlockHash]) -> Victims | None:
        if n == 0:
            return []
        candidates: Victims = []
        for key, block in self.blocks.items():
            if block.ref_cnt == 0 and key not in protected:
                candidates.append((key, block))
                if len(candidates) == n:
                    break
        if len(candidates) < n:
            return None
        for key, _ in candidates:
            del self.blocks[key]
        return candidates


class RefARCPolicy:
    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[BlockHash, RefBlockStatus] = OrderedDict()
        self.t2: OrderedDict[BlockHash, RefBlockStatus] = OrderedDict()
        self.b1: OrderedDict[BlockHash, None] = OrderedDict()
        self.b2: OrderedDict[BlockHash, None] = OrderedDict()

    def get(self, key: BlockHash) -> RefBlockStatus | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: BlockHash, block: RefBlockStatus) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: BlockHash) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def touch(self, keys: Iterable[BlockHash]) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                block = self.t1.pop(key)
                if not block.is_ready:
                    self.t1[key] = block  # a store in flight is not a second use
                else:
                    self.t2[key] = block
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                delta = max(1, len(self.b2) / len(self.b1))
                self.target_t1_size = min(self.target_t1_size + delta, self.cache_capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                delta = max(1, len(self.b1) / len(self.b2))
                self.target_t1_size = max(self.target_t1_size - delta, 0)
                self.b2.move_to_end(key)

    def _first_evictable(
        self,
        entries: OrderedDict[BlockHash, RefBlockStatus],
        protected: set[BlockHash],
        selected: set[BlockHash],
    ) -> tuple[BlockHash, RefBlockStatus] | None:
        for key, block in entries.items():
            if block.ref_cnt == 0 and key not in protected and key not in selected:
                return key, block
        return None

    def evict(self, n: int, protected: set[BlockHash]) -> Victims | None:
        if n == 0:
            return []
        candidates: list[tuple[BlockHash, RefBlockStatus, bool]] = []
        selected: set[BlockHash] = set()
        virtual_t1_size = len(self.t1)
        for _ in range(n):
            candidate: tuple[BlockHash, RefBlockStatus, bool] | None = None
            if virtual_t1_size >= int(self.target_t1_size):
                found = self._first_evictable(self.t1, protected, selected)
                if found is not None:
                    candidate = (found[0], found[1], True)
                    virtual_t1_size -= 1
            if candidate is None:
                found = self._first_evictable(self.t2, protected, selected)
                if found is None:
                    return None
                candidate = (found[0], found[1], False)
            candidates.append(candidate)
            selected.add(candidate[0])
        result: Victims = []
        for key, block, from_t1 in candidates:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            result.append((key, block))
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.cache_capacity):
                ghost.popitem(last=False)
        return result


_POLICIES: dict[str, type[RefLRUPolicy] | type[RefARCPolicy]] = {
    "lru": RefLRUPolicy,
    "arc": RefARCPolicy,
}


class ReferenceCPUOffloadingManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        cache_policy: str = "lru",
        enable_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.medium = CPULoadStoreSpec.medium()
        self._num_blocks = num_blocks
        self._num_allocated_blocks = 0
        self._free_list: list[int] = []
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._policy = _POLICIES[cache_policy](cache_capacity=num_blocks)

    def _get_num_free_blocks(self) -> int:
        return len(self._free_list) + self._num_blocks - self._num_allocated_blocks

    def _allocate_blocks(self, block_hashes: list[BlockHash]) -> list[RefBlockStatus]:
        num_fresh = min(len(block_hashes), self._num_blocks - self._num_allocated_blocks)
        num_reused = len(block_hashes) - num_fresh
        assert len(self._free_list) >= num_reused
        blocks: list[RefBlockStatus] = []
        for _ in range(num_fresh):
            blocks.append(RefBlockStatus(self._num_allocated_blocks))
            self._num_allocated_blocks += 1
        for _ in range(num_reused):
            blocks.append(RefBlockStatus(self._free_list.pop()))
        return blocks

    def _free_block(self, block: RefBlockStatus) -> None:
        self._free_list.append(block.block_id)

    def _spec(self, blocks: Iterable[RefBlockStatus]) -> CPULoadStoreSpec:
        return CPULoadStoreSpec([block.block_id for block in blocks])

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        hit_count = 0
        for key in block_hashes:
            block = self._policy.get(key)
            if block is None or not block.is_ready:
                break
            hit_count += 1
        return hit_count

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> CPULoadStoreSpec:
        blocks = []
        for key in block_hashes:
            block = self._policy.get(key)
            assert block is not None, f"Block {key!r} not found in cache"
            assert block.is_ready, f"Block {key!r} is not ready for reading"
            block.ref_cnt += 1
            blocks.append(block)
        return self._spec(blocks)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        self._policy.touch(block_hashes)

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        for key in block_hashes:
            block = self._policy.get(key)
            assert block is not None, f"Block {key!r} not found"
            assert block.ref_cnt > 0, f"Block {key!r} ref_cnt is already 0"
            block.ref_cnt -= 1

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        block_hashes_list = list(block_hashes)
        to_store = [key for key in block_hashes_list if self._policy.get(key) is None]
        if not to_store:
            return PrepareStoreOutput([], self._spec([]), [])
        num_blocks_to_evict = len(to_store) - self._get_num_free_blocks()
        to_evict: list[BlockHash] = []
        if num_blocks_to_evict > 0:
            evicted = self._policy.evict(num_blocks_to_evict, set(block_hashes_list))
            if evicted is None:
                return None
            for key, block in evicted:
                self._free_block(block)
                to_evict.append(key)
        if to_evict and self.events is not None:
            self.events.append(OffloadingEvent(to_evict, self.block_size, self.medium, True))
        blocks = self._allocate_blocks(to_store)
        assert len(blocks) == len(to_store)
        for key, block in zip(to_store, blocks, strict=True):
            self._policy.insert(key, block)
        return PrepareStoreOutput(to_store, self._spec(blocks), to_evict)

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        stored: list[BlockHash] = []
        if success:
            for key in block_hashes:
                block = self._policy.get(key)
                if block is not None and not block.is_ready:
                    block.ref_cnt = 0
                    stored.append(key)
        else:
            for key in block_hashes:
                block = self._policy.get(key)
                if block is not None and not block.is_ready:
                    self._policy.remove(key)
                    self._free_block(block)
        if stored and self.events is not None:
            self.events.append(OffloadingEvent(stored, self.block_size, self.medium, False))

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self.events is not None:
            yield from self.events
            self.events.clear()
