"""The free-block queue: every block with reference count 0, in eviction order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvtier.gpu.block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """A doubly linked list threaded through the blocks themselves.

    Not a deque, because a prefix hit must pull a cached block out of the MIDDLE of the
    queue in O(1); and the links live on the blocks, so no operation allocates. Two
    sentinel blocks (id -1) remove every empty-list branch.

    Order: the head is evicted first. Blocks start in id order; freed blocks are
    appended at the tail, and a request frees its blocks tail-first, so among blocks
    freed together the end of a prompt is evicted before its start.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Take the head (next eviction victim)."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the first n blocks, in order; the caller has checked n <= num_free_blocks."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} free")
        taken: list[KVCacheBlock] = []
        first = self._head.next_free
        assert first is not None
        block: KVCacheBlock = first
        for _ in range(n):
            taken.append(block)
            following = block.next_free
            block.prev_free = block.next_free = None
            # n <= num_free_blocks: the walk ends on the tail sentinel at most
            block = following  # type: ignore[assignment]
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue in O(1)."""
        self.remove_all([block])

    def remove_all(self, blocks: list[KVCacheBlock]) -> None:
        """Unlink every given block (all must be in the queue, each listed once; O(len)).

        Checked block by block: a failure leaves the blocks before it unlinked (and the
        count stale), so callers hand in only blocks known to be queued (`BlockPool.touch`
        does: reference count 0, each once).
        """
        for block in blocks:
            prev_block, next_block = block.prev_free, block.next_free
            if prev_block is None or next_block is None:
                raise ValueError(f"block {block.block_id} is not in the free queue")
            prev_block.next_free = next_block
            next_block.prev_free = prev_block
            block.prev_free = block.next_free = None
        self.num_free_blocks -= len(blocks)

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append blocks at the tail in the given order (the first is evicted first)."""
        if type(blocks) is not list:
            blocks = list(blocks)
        last = self._tail.prev_free
        assert last is not None
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def release_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those left with none join the tail in
        the given order (a block listed twice joins at its last listing). `append_n`
        of the freed blocks in one walk: every finished request frees its blocks."""
        last = self._tail.prev_free
        assert last is not None
        count = 0
        for block in blocks:
            block.ref_cnt -= 1
            if not block.ref_cnt:
                last.next_free = block
                block.prev_free = last
                last = block
                count += 1
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += count

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block at the head (reused first): for blocks holding nothing cacheable."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head to tail (for tests and inspection; O(n))."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks
