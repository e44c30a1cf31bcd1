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
    """

    def __init__(self, block_size: int, num_blocks: int) -> None:
        super().__init__(block_size, CPULoadStoreSpec.medium(), num_blocks)
        self._capacity = num_blocks
        self._num_allocated = 0  # slots 0.._num_allocated-1 have been used once
        self._free_ids: list[int] = []

    def get_num_free_blocks(self) -> int:
        return len(self._free_ids) + self._capacity - self._num_allocated

    def allocate_blocks(self, block_hashes: Sequence[BlockHash]) -> list[BlockStatus]:
        n = len(block_hashes)
        num_fresh = min(n, self._capacity - self._num_allocated)
        num_reused = n - num_fresh
        free_ids = self._free_ids
        if num_reused > len(free_ids):
            raise ValueError(
                f"cannot allocate {n} blocks: only {self.get_num_free_blocks()} of "
                f"{self._capacity} are free"
            )
        start = self._num_allocated
        self._num_allocated = start + num_fresh
        blocks = [BlockStatus(i) for i in range(start, start + num_fresh)]
        for _ in range(num_reused):
            blocks.append(BlockStatus(free_ids.pop()))
        return blocks

    def free(self, block: BlockStatus) -> None:
        self._free_ids.append(block.block_id)

    def free_blocks(self, blocks: Iterable[BlockStatus]) -> None:
        self._free_ids.extend([block.block_id for block in blocks])

    def get_load_store_spec(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[BlockStatus]
    ) -> CPULoadStoreSpec:
        return CPULoadStoreSpec([block.block_id for block in blocks])
