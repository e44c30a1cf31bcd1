"""Hashes held by several blocks: registered and evicted, the index stays exact.

The pool evicts without checking each entry while no hash names several blocks (it
counts those hashes); these cases cross that line both ways, and register three
copies of one hash in one call.
"""

from __future__ import annotations

from kvtier import Request
from kvtier.hashing import hash_request_blocks
from kvtier.types import BlockHash
from tests.pool.helpers import allocate, make


def _index(m: object) -> list[tuple[BlockHash, list[int]]]:
    pool = m.block_pool  # type: ignore[attr-defined]
    return sorted((h, [b.block_id for b in bs]) for h, bs in pool.cached_items())


def test_one_hash_three_times_in_one_request_is_three_copies_in_order() -> None:
    m = make(num_blocks=6, enable_kv_cache_events=False)
    (h,) = hash_request_blocks(range(4), 4)
    a = Request.from_block_hashes("a", [h, h, h], 13, block_size=4)
    allocate(m, a, 13)  # no prefix hit asked: three new blocks under one hash
    assert _index(m) == [(h, [0, 1, 2])]
    assert m.block_pool.get_cached_block(h).block_id == 0  # type: ignore[union-attr]


def _other(name: str, first_token: int, num_blocks: int) -> Request:
    hashes = hash_request_blocks(range(first_token, first_token + 4 * num_blocks), 4)
    return Request.from_block_hashes(name, hashes, 4 * num_blocks, block_size=4)


def test_evicting_every_copy_in_one_call_empties_the_index_and_reports_each() -> None:
    seen: list[BlockHash] = []
    m = make(num_blocks=4, on_evict=seen.append)
    (h,) = hash_request_blocks(range(4), 4)
    a = Request.from_block_hashes("a", [h, h, h], 12, block_size=4)
    allocate(m, a, 12)
    m.free(a)  # tail first: the free queue is 3 (never used), 2, 1, 0
    x = _other("x", 100, 4)
    allocate(m, x, 16)  # takes all four blocks, three copies of h among them
    assert seen == [h, h, h] and m.block_pool.num_evicted == 3
    assert _index(m) == sorted(
        (hx, [i]) for i, hx in zip([3, 2, 1, 0], x.block_hashes, strict=True)
    )
    m.free(x)
    # No copies are left: this eviction takes the unchecked path, and still reports.
    seen.clear()
    allocate(m, _other("y", 200, 4), 16)
    assert sorted(seen) == sorted(x.block_hashes) and len(_index(m)) == 4
    assert m.block_pool.num_evicted == 7


def test_copies_evicted_in_separate_calls_leave_the_others_cached() -> None:
    seen: list[BlockHash] = []
    m = make(num_blocks=5, on_evict=seen.append, enable_kv_cache_events=False)
    (h,) = hash_request_blocks(range(4), 4)
    a = Request.from_block_hashes("a", [h, h], 8, block_size=4)
    allocate(m, a, 8)
    m.free(a)  # the free queue: 2, 3, 4 (never used), then 1, 0
    allocate(m, _other("x", 100, 3), 12)  # blocks 2, 3, 4: no copy of h evicted
    assert (h, [0, 1]) in _index(m) and seen == []
    allocate(m, _other("y", 200, 1), 4)  # block 1: one copy goes, block 0 still holds h
    assert (h, [0]) in _index(m) and seen == [h]
    blocks, hit = m.get_computed_blocks(Request.from_block_hashes("b", [h], 5, block_size=4))
    assert hit == 4 and blocks[0].block_id == 0
    allocate(m, _other("z", 300, 1), 4)  # block 0: the last copy goes
    assert all(block_hash != h for block_hash, _ in _index(m)) and seen == [h, h]


def test_evictions_are_counted_without_a_hook_or_events() -> None:
    m = make(num_blocks=3, enable_kv_cache_events=False)
    allocate(m, _other("a", 0, 3), 12)
    assert m.block_pool.on_evict is None and m.block_pool.num_evicted == 0
    m.free(Request.from_block_hashes("a", [], 12, block_size=4))
    allocate(m, _other("b", 100, 2), 8)  # two of a's cached blocks go
    assert m.block_pool.num_evicted == 2
