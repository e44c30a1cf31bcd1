"""Sliding-window attention: release outside the window, hits that need only the window."""

from __future__ import annotations

from kvtier import Request
from kvtier.gpu.block import KVCacheBlock
from kvtier.gpu.sliding_window import find_sliding_window_hit, num_window_blocks
from kvtier.types import BlockHash, int_block_hash
from tests.pool.helpers import allocate, append, make, snapshot

NULL = 0  # the placeholder block id


def test_window_block_count() -> None:
    assert num_window_blocks(8, 4) == 2  # 7 earlier tokens span 2 blocks
    assert num_window_blocks(9, 4) == 2
    assert num_window_blocks(10, 4) == 3


def test_hit_search_right_to_left() -> None:
    null = KVCacheBlock(0, is_null=True)
    blocks = {int_block_hash(i): KVCacheBlock(10 + i) for i in (1, 2, 4)}
    hashes = [int_block_hash(i) for i in range(6)]

    def hit(max_blocks: int, contiguous: int) -> list[int]:
        found = find_sliding_window_hit(blocks.get, hashes, max_blocks, contiguous, null)
        return [b.block_id for b in found]

    assert hit(5, 2) == [NULL, 11, 12]  # run 1-2 is enough; block 0 is not needed
    assert hit(6, 1) == [NULL, NULL, NULL, NULL, 14]  # the rightmost block alone will do
    assert hit(6, 3) == []  # no run of 3, and block 0 is a miss
    starting = {int_block_hash(i): KVCacheBlock(10 + i) for i in (0, 1, 3)}
    found = find_sliding_window_hit(starting.get, hashes, 5, 3, null)
    assert [b.block_id for b in found] == [10, 11]  # a short run from block 0 still counts


def _decode(manager, request, steps: int) -> None:  # type: ignore[no-untyped-def]
    for _ in range(steps):
        request.append_output_token_ids(1)
        assert append(manager, request, 1) is not None


def test_blocks_outside_the_window_are_released_during_decode() -> None:
    m = make(num_blocks=10, sliding_window=8)
    assert m.num_free_blocks == 9  # block 0 is the placeholder
    a = Request("a", list(range(8)))
    allocate(m, a, 8)
    assert m.get_block_ids("a") == [1, 2]
    _decode(m, a, 3)  # 11 computed
    assert m.get_block_ids("a") == [1, 2, 3]
    _decode(m, a, 1)  # token 11 attends to 4..11: block 0 is released first
    assert m.get_block_ids("a") == [NULL, 2, 3]
    _decode(m, a, 1)
    assert m.get_block_ids("a") == [NULL, 2, 3, 4]
    released = m.block_pool.blocks[1]
    assert released.ref_cnt == 0 and released.block_hash == a.block_hashes[0]
    assert [b.block_id for b in m.block_pool.free_block_queue][-1] == 1
    assert m.get_num_common_prefix_blocks(a, 1) == 0
    m.free(a)
    assert m.num_free_blocks == 9


def test_hit_needs_only_the_last_window() -> None:
    m = make(num_blocks=10, sliding_window=8)
    a = Request("a", list(range(8)))
    allocate(m, a, 8)
    _decode(m, a, 5)  # table [null, 2, 3, 4]; block 1 released but still cached
    b = Request("b", [*a.all_token_ids[:12], 99])
    blocks, hit = m.get_computed_blocks(b)
    assert [x.block_id for x in blocks] == [NULL, 2, 3] and hit == 12
    assert allocate(m, b, 1, blocks) is not None
    assert m.get_block_ids("b") == [NULL, 2, 3, 5]
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [0, 2, 2]


def test_released_blocks_count_as_room_and_failure_releases_nothing() -> None:
    m = make(num_blocks=4, sliding_window=4)
    a = Request("a", list(range(12)))
    allocate(m, a, 12)  # blocks 1, 2, 3: the pool is full
    a.append_output_token_ids(1)
    assert m.num_free_blocks == 0
    new = append(m, a, 1)  # needs 1 block; blocks 1 and 2 leave the window
    assert new is not None and m.get_block_ids("a") == [NULL, NULL, 3, new[0].block_id]
    removed = [e for e in m.take_events() if type(e).__name__ == "BlockRemoved"]
    assert len(removed) == 1

    tight = make(num_blocks=5, sliding_window=8)
    b = Request("b", list(range(12)))
    allocate(tight, b, 12)
    shared = Request("c", list(range(9)))
    blocks, _ = tight.get_computed_blocks(shared)
    assert allocate(tight, shared, 1, blocks) is not None  # shares b's first blocks
    assert tight.num_free_blocks == 0
    b.append_output_token_ids(1)
    before = snapshot(tight, ["b", "c"])
    assert append(tight, b, 1) is None
    assert snapshot(tight, ["b", "c"]) == before


def test_hash_ids_are_opaque() -> None:
    m = make(num_blocks=6, sliding_window=5, block_size=2)
    hashes: list[BlockHash] = [int_block_hash(i) for i in range(3)]
    r = Request.from_block_hashes("t", hashes, 7, block_size=2)
    allocate(m, r, 7)
    again = Request.from_block_hashes("u", hashes, 7, block_size=2)
    blocks, hit = m.get_computed_blocks(again)
    assert hit == 6 and [b.block_id for b in blocks] == [NULL, 2, 3]
