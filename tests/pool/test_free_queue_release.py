"""`release_n`: drop a reference from each block, queue those left with none, in order."""

from __future__ import annotations

from kvtier.gpu.block import KVCacheBlock
from kvtier.gpu.free_queue import FreeKVCacheBlockQueue


def test_only_blocks_left_unreferenced_join_the_tail_in_the_given_order() -> None:
    queued = [KVCacheBlock(0)]
    queue = FreeKVCacheBlockQueue(queued)
    held = [KVCacheBlock(i) for i in range(1, 5)]
    for block, refs in zip(held, [1, 2, 1, 1], strict=True):
        block.ref_cnt = refs
    queue.release_n(reversed(held))  # an iterator: a request frees its table tail first
    assert [b.block_id for b in queue] == [0, 4, 3, 1] and len(queue) == 4
    assert held[1].ref_cnt == 1 and held[1].prev_free is None and held[1].next_free is None


def test_a_block_listed_twice_joins_once_at_its_last_listing() -> None:
    queue = FreeKVCacheBlockQueue([])
    a, b = KVCacheBlock(1), KVCacheBlock(2)
    a.ref_cnt, b.ref_cnt = 2, 1
    queue.release_n([a, b, a])
    assert [x.block_id for x in queue] == [2, 1] and len(queue) == 2
    assert a.ref_cnt == b.ref_cnt == 0
    assert [x.block_id for x in queue.popleft_n(2)] == [2, 1] and len(queue) == 0
