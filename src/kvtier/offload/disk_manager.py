"""The disk tier on the scheduler side: a `Backend` whose blocks are files named by hash.

Slot ids only count capacity (files are addressed by block hash, which is what
lets a restart find them again), so the backend remembers each slot's hash: when
the manager frees a slot (eviction, failed store) the file must go too, and
`Backend.free` receives only the slot. Deleting is the data plane's business; the
backend calls `on_free(hashes)` (typically `DiskStore.discard`) and imports
nothing from it, so this module stays bookkeeping only (no torch, no I/O of its own).

`DiskOffloadingManager` adds the two things a persistent tier needs beyond the
generic manager: `adopt` (register blocks recovered from the directory at start)
and `discard` (forget ready blocks the data plane found corrupt). Over a directory
other engines write too (`kvtier.store.shared_disk`), a `probe` says whether a block
it does not know is there: a lookup that stops at such a block adopts it and goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.offload.backend import Backend, BlockStatus
from kvtier.offload.policy_manager import PolicyOffloadingManager
from kvtier.types import BlockHash

OnFree = Callable[[Sequence[BlockHash]], None]
Probe = Callable[[BlockHash], bool]


class DiskLoadStoreSpec(LoadStoreSpec):
    """Blocks on local disk: their hashes (file names), and their capacity slots."""

    __slots__ = ("block_hashes", "block_ids")

    def __init__(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        self.block_hashes = list(block_hashes)
        self.block_ids = list(block_ids)

    @staticmethod
    def medium() -> str:
        return "DISK"

    def __len__(self) -> int:
        return len(self.block_hashes)

    def __repr__(self) -> str:
        return f"DiskLoadStoreSpec({[h.hex() for h in self.block_hashes]})"


class DiskBackend(Backend):
    """`num_blocks` capacity slots; freed slots are reused most recently freed first."""

    def __init__(self, block_size: int, num_blocks: int, on_free: OnFree | None = None) -> None:
        super().__init__(block_size, DiskLoadStoreSpec.medium(), num_blocks)
        self._capacity = num_blocks
        self._num_allocated = 0
        self._free_ids: list[int] = []
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._on_free = on_free

    def get_num_free_blocks(self) -> int:
        return len(self._free_ids) + self._capacity - self._num_allocated

    def allocate_blocks(self, block_hashes: Sequence[BlockHash]) -> list[BlockStatus]:
        if len(block_hashes) > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {len(block_hashes)} disk blocks: only "
                f"{self.get_num_free_blocks()} of {self._capacity} are free"
            )
        blocks: list[BlockStatus] = []
        for block_hash in block_hashes:
            if self._num_allocated < self._capacity:
                slot = self._num_allocated
                self._num_allocated += 1
            else:
                slot = self._free_ids.pop()
            self._hash_of[slot] = block_hash
            blocks.append(BlockStatus(slot))
        return blocks

    def free(self, block: BlockStatus) -> None:
        self.free_blocks([block])

    def free_blocks(self, blocks: Iterable[BlockStatus]) -> None:
        freed: list[BlockHash] = []
        for block in blocks:
            block_hash = self._hash_of[block.block_id]
            if block_hash is not None:
                freed.append(block_hash)
                self._hash_of[block.block_id] = None
            self._free_ids.append(block.block_id)
        if freed and self._on_free is not None:
            self._on_free(freed)

    def get_load_store_spec(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[BlockStatus]
    ) -> DiskLoadStoreSpec:
        return DiskLoadStoreSpec(block_hashes, [block.block_id for block in blocks])


class DiskOffloadingManager(PolicyOffloadingManager):
    """The generic manager over a `DiskBackend`, plus `adopt` and `discard`."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        cache_policy: str = "lru",
        enable_events: bool = False,
        on_free: OnFree | None = None,
        probe: Probe | None = None,
    ) -> None:
        super().__init__(DiskBackend(block_size, num_blocks, on_free), cache_policy, enable_events)
        self.block_size = block_size
        self.medium = self.backend.medium
        self._probe = probe

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        """The generic lookup; with a `probe`, blocks other engines wrote are adopted
        where it stops (a probe a block, one more for the first one absent), as long as
        they fit (adopting may evict this tier's least valued blocks, as a store would)."""
        hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
        hits = super().lookup(hashes)
        if self._probe is None or hits is None:
            return hits
        while hits < len(hashes) and hashes[hits] not in self and self._probe(hashes[hits]):
            if self.adopt([hashes[hits]]):
                break  # no room (every block pinned)
            hits += 1
        return hits

    def reset_cache(self) -> list[BlockHash]:
        """The generic reset; blocks other engines wrote are not adopted after it: they
        may be of the weights the reset left (see the README's shared disk tier)."""
        self._probe = None
        return super().reset_cache()

    @classmethod
    def reopened(
        cls,
        block_size: int,
        num_blocks: int,
        recovered: Sequence[BlockHash],
        on_free: OnFree,
        cache_policy: str = "lru",
        enable_events: bool = False,
        probe: Probe | None = None,
    ) -> DiskOffloadingManager:
        """The manager of a directory that already holds `recovered` (oldest first):
        they are adopted, and those that do not fit are handed to `on_free` to delete,
        so the directory never holds more than the budget."""
        manager = cls(block_size, num_blocks, cache_policy, enable_events, on_free, probe)
        left_over = manager.adopt(recovered) if recovered else []
        if left_over:
            on_free(left_over)
        return manager

    def adopt(self, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Register blocks already durable on disk (recovery), oldest first.

        They go through the ordinary two-phase store, so policies, counters and
        events see them like any store; returns the hashes that did not fit.
        """
        free = self.backend.get_num_free_blocks()
        fitting = [h for h in block_hashes if h not in self][:free]
        output = self.prepare_store(fitting)
        if output is None:  # cannot happen with free slots; keep the contract anyway
            return list(block_hashes)
        self.complete_store(output.block_hashes_to_store)
        adopted = set(output.block_hashes_to_store)
        return [h for h in block_hashes if h not in adopted and h not in self]

    def discard(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """Forget ready, unpinned blocks (found corrupt); returns those removed.

        Pinned blocks (a load in flight) and stores in flight are left alone: the
        data plane reports them again when their job ends. The generic manager's
        `remove_ready` does the removal (slots freed, so files deleted, one event).
        """
        return self.remove_ready(block_hashes)
