"""Delayed caching: `allocate_slots(delay_cache_blocks=True)` then `cache_blocks`.

An engine that loads KV asynchronously must not let another request hit a block
before its bytes arrive; these tests pin that the hash index stays silent until
`cache_blocks`, and that `cache_blocks` is the ordinary caching path afterwards.
"""

from __future__ import annotations

import pytest

from kvtier import Request
from kvtier.gpu import BlockStored
from kvtier.hashing import hash_request_blocks
from tests.pool.helpers import allocate, make, snapshot


def _hashes(request: Request, m):  # type: ignore[no-untyped-def]
    return request.get_block_hashes(m.block_size, m.hash_algorithm)


def test_delayed_blocks_are_not_hits_until_cached() -> None:
    m = make()
    a = Request("a", list(range(14)))  # 3 full blocks and a partial one
    assert allocate(m, a, 14, delay_cache_blocks=True) is not None
    assert a.num_computed_tokens == 14  # the slots are allocated as usual
    assert m.get_num_cached_blocks("a") == 0 and m.take_events() == []
    assert not any(m.is_cached(h) for h in _hashes(a, m))
    b = Request("b", list(range(14)))
    assert m.get_computed_blocks(b) == ([], 0)

    m.cache_blocks(a, 8)  # two blocks' bytes are there
    hashes = _hashes(a, m)
    assert [m.is_cached(h) for h in hashes] == [True, True, False]
    (event,) = m.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == tuple(hashes[:2]) and event.parent_block_hash is None
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8 and [x.block_id for x in blocks] == m.get_block_ids("a")[:2]

    m.cache_blocks(a, 8)  # idempotent: nothing new, no event
    m.cache_blocks(a, 5)
    assert m.take_events() == [] and m.get_num_cached_blocks("a") == 2
    m.cache_blocks(a, 14)
    (event,) = m.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (hashes[2],) and event.parent_block_hash == hashes[1]
    assert event.token_ids == tuple(range(8, 12))
    assert m.get_num_cached_blocks("a") == 3


def test_delay_keeps_the_accelerator_hit_and_caches_after_it() -> None:
    m = make()
    a = Request("a", list(range(9)))
    allocate(m, a, 9)
    m.free(a)
    b = Request("b", [*range(8), 50, 51, 52, 53, 54])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8
    m.take_events()
    allocate(m, b, b.num_tokens - hit, blocks, delay_cache_blocks=True)
    assert m.get_num_cached_blocks("b") == 2 and m.take_events() == []
    third = hash_request_blocks(b.all_token_ids, 4)[2]
    assert not m.is_cached(third)
    m.cache_blocks(b, 12)
    assert m.is_cached(third) and m.get_num_cached_blocks("b") == 3


def test_default_caches_at_allocation_as_before() -> None:
    m = make()
    a = Request("a", list(range(14)))
    allocate(m, a, 14)
    assert m.get_num_cached_blocks("a") == 3
    assert all(m.is_cached(h) for h in _hashes(a, m))


def test_cache_blocks_errors_leave_state_unchanged() -> None:
    m = make()
    with pytest.raises(KeyError, match="holds no blocks"):
        m.cache_blocks(Request("ghost", list(range(8))), 4)
    a = Request("a", list(range(14)))
    allocate(m, a, 14, delay_cache_blocks=True)
    before = snapshot(m, ["a"])
    with pytest.raises(ValueError, match="slots for 14 tokens"):
        m.cache_blocks(a, 15)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        m.cache_blocks(a, -1)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        m.cache_blocks(a, True)
    assert snapshot(m, ["a"]) == before
    m.free(a)
    with pytest.raises(KeyError, match="holds no blocks"):
        m.cache_blocks(a, 4)


def test_delay_refused_with_a_sliding_window() -> None:
    m = make(sliding_window=8)
    a = Request("a", list(range(14)))
    before = snapshot(m, ["a"])
    with pytest.raises(ValueError, match="sliding window"):
        allocate(m, a, 14, delay_cache_blocks=True)
    assert snapshot(m, ["a"]) == before and a.num_computed_tokens == 0
