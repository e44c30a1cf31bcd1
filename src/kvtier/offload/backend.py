"""The slot allocator of one offload medium, and the status of one stored block.

Managers own reference counts and policies own ordering; a backend only hands out
and takes back storage slots, and says how to address them (a `LoadStoreSpec`).
A new medium (disk, remote) is a new `Backend` subclass; the generic manager in
`kvtier.offload.policy_manager` drives any of them with any policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.types import BlockHash
from kvtier.validate import positive_int


class BlockStatus:
    """One stored block: its reference count and its slot.

    `ref_cnt` is -1 while a store is in flight (not readable), 0 when ready and
    evictable, n > 0 while n loads read it (pinned). A plain `__slots__` class
    rather than vLLM's ctypes structure: attribute access is several times
    cheaper, and this object is touched on every hot-path call.
    """

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.ref_cnt: int = -1
        self.block_id: int = block_id

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"BlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class Backend(ABC):
    """Allocates and frees the slots of one medium.

    `num_blocks` is the medium's capacity in blocks when it has a fixed one; the
    ARC policy sizes its ghost lists from it (vLLM falls back to the free-block
    count at construction when a backend has none, and so do we).
    """

    def __init__(self, block_size: int, medium: str, num_blocks: int | None = None) -> None:
        positive_int("block_size", block_size)
        if num_blocks is not None:
            positive_int("num_blocks", num_blocks, minimum=0)
        self.block_size = block_size
        self.medium = medium
        self.num_blocks = num_blocks

    @abstractmethod
    def get_num_free_blocks(self) -> int:
        """How many blocks `allocate_blocks` can hand out right now."""

    @abstractmethod
    def allocate_blocks(self, block_hashes: Sequence[BlockHash]) -> list[BlockStatus]:
        """One new not-ready block (ref_cnt -1) per hash, in order.

        Raises ValueError (and allocates nothing) when fewer than
        `len(block_hashes)` blocks are free.
        """

    @abstractmethod
    def free(self, block: BlockStatus) -> None:
        """Give back a block's slot; call once per block from `allocate_blocks`."""

    def free_blocks(self, blocks: Iterable[BlockStatus]) -> None:
        """Free several blocks in order (a batch hook: one call per eviction, not per block)."""
        for block in blocks:
            self.free(block)

    @abstractmethod
    def get_load_store_spec(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[BlockStatus]
    ) -> LoadStoreSpec:
        """Where the given blocks live, in the order given."""
