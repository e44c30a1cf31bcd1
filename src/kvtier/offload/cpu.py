"""CPU memory as an offload medium: a fixed array of `num_blocks` slots."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.offload.backend import Backend, BlockStatus
from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.types import BlockHash


class CPUBackend(Backend):
    """Slot ids 0..num_blocks-1: never-used slots first in increasing order, then
    freed slots, most recently freed first (a stack: the slot just freed is the
    one most likely still warm in the CPU caches, and vLLM hands them out so).

    A freed `BlockStatus` object is reused for its slot's next allocation (reset to
    not ready), which saves an allocation per stored block; callers must not keep
    block objects after freeing them.
    """

    def __init__(self, block_size: int, num_blocks: int) -> None:
        super().__init__(block_size, CPULoadStoreSpec.medium(), num_blocks)
        self._capacity = num_blocks
        self._num_allocated = 0  # slots 0.._num_allocated-1 have been used once
        self._free: list[BlockStatus] = []  # freed blocks, most recently freed last

    def get_num_free_blocks(self) -> int:
        return len(self._free) + self._capacity - self._num_allocated

    def allocate_blocks(self, block_hashes: Sequence[BlockHash]) -> list[BlockStatus]:
        n = len(block_hashes)
        num_fresh = min(n, self._capacity - self._num_allocated)
        num_reused = n - num_fresh
        free = self._free
        if num_reused > len(free):
            raise ValueError(
                f"cannot allocate {n} blocks: only {self.get_num_free_blocks()} of "
                f"{self._capacity} are free"
            )
        reused = free[: -num_reused - 1 : -1] if num_reused else []  # most recently freed first
        if num_reused:
            del free[-num_reused:]
            for block in reused:
                block.ref_cnt = -1
        if not num_fresh:  # the steady state: every slot has been used once
            return reused
        start = self._num_allocated
        self._num_allocated = start + num_fresh
        return [BlockStatus(i) for i in range(start, start + num_fresh)] + reused

    def free(self, block: BlockStatus) -> None:
        self._free.append(block)

    def free_blocks(self, blocks: Iterable[BlockStatus]) -> None:
        self._free.extend(blocks)

    def get_load_store_spec(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[BlockStatus]
    ) -> CPULoadStoreSpec:
        # a slot's status object keeps its slot for life: the ids are read when needed
        return CPULoadStoreSpec.of_blocks(blocks)
