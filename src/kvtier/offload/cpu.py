"""CPU memory as an offload medium: a fixed array of `num_blocks` slots."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.offload.backend import Backend, BlockStatus
from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.types import BlockHash


class CPUBackend(Backend):
    """Slot ids 0..num_blocks-1. vLLM's order (the default): never-used slots first in
    increasing order, then freed slots, most recently freed first (a stack: the slot
    just freed is the one most likely still warm in the CPU caches).

    `reuse_freed_first=True` hands out freed slots (most recently freed first) before
    never-used ones (in increasing order). The host buffer behind the slots is mapped
    lazily (`kvtier.store.memory`): a slot costs resident memory from its first write
    on, so with this order the slots ever used are never more than the most ever held
    at once. vLLM's order instead walks into fresh slots after every reset or failed
    store, until the whole buffer is resident; the two orders differ only while freed
    and never-used slots coexist (eviction starts only once every slot is taken).

    A freed `BlockStatus` object is reused for its slot's next allocation (reset to
    not ready), which saves an allocation per stored block; callers must not keep
    block objects after freeing them.
    """

    def __init__(
        self, block_size: int, num_blocks: int, *, reuse_freed_first: bool = False
    ) -> None:
        super().__init__(block_size, CPULoadStoreSpec.medium(), num_blocks)
        self._capacity = num_blocks
        self._num_allocated = 0  # slots 0.._num_allocated-1 have been used once
        self._free: list[BlockStatus] = []  # freed blocks, most recently freed last
        self.reuse_freed_first = reuse_freed_first

    @property
    def num_used_slots(self) -> int:
        """Slots handed out at least once (each of them resident once written)."""
        return self._num_allocated

    def get_num_free_blocks(self) -> int:
        return len(self._free) + self._capacity - self._num_allocated

    def allocate_blocks(self, block_hashes: Sequence[BlockHash]) -> list[BlockStatus]:
        n = len(block_hashes)
        free = self._free
        if n > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {n} blocks: only {self.get_num_free_blocks()} of "
                f"{self._capacity} are free"
            )
        if self.reuse_freed_first:
            num_reused = min(n, len(free))
            num_fresh = n - num_reused
        else:
            num_fresh = min(n, self._capacity - self._num_allocated)
            num_reused = n - num_fresh
        reused = free[: -num_reused - 1 : -1] if num_reused else []  # most recently freed first
        if num_reused:
            del free[-num_reused:]
            for block in reused:
                block.ref_cnt = -1
        if not num_fresh:  # the steady state: every slot has been used once
            return reused
        start = self._num_allocated
        self._num_allocated = start + num_fresh
        fresh = [BlockStatus(i) for i in range(start, start + num_fresh)]
        return reused + fresh if self.reuse_freed_first else fresh + reused

    def free(self, block: BlockStatus) -> None:
        self._free.append(block)

    def free_blocks(self, blocks: Iterable[BlockStatus]) -> None:
        self._free.extend(blocks)

    def get_load_store_spec(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[BlockStatus]
    ) -> CPULoadStoreSpec:
        # a slot's status object keeps its slot for life: the ids are read when needed
        return CPULoadStoreSpec.of_blocks(blocks)
