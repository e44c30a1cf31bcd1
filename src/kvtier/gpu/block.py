"""One KV cache block's metadata."""

from __future__ import annotations

from kvtier.types import BlockHash


class KVCacheBlock:
    """A block id with its reference count, optional hash and free-queue links.

    A plain `__slots__` class rather than a dataclass: these fields are read and written
    on every allocation, and the links are only ever touched by `FreeKVCacheBlockQueue`.
    `block_hash` is set once the block is full and registered in the prefix cache, and
    cleared when the block is evicted from it.
    """

    __slots__ = ("block_hash", "block_id", "is_null", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int, *, is_null: bool = False) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        # The sliding-window placeholder: stands for blocks no longer needed.
        self.is_null = is_null

    def __repr__(self) -> str:
        prev_id = self.prev_free.block_id if self.prev_free else None
        next_id = self.next_free.block_id if self.next_free else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self.block_hash!r}, prev_free={prev_id}, next_free={next_id})"
        )
