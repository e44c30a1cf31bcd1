"""Where a scheduler written for vLLM's seed `KVCacheManager` would break on kvtier.

Each test pins a decision of docs/semantics.md (section 2, the accelerator pool).
"""

from __future__ import annotations

import pytest

from kvtier import Request
from tests.pool.helpers import allocate, make, snapshot


def test_the_scheduler_owns_num_computed_tokens() -> None:
    m = make()
    a = Request("a", list(range(10)))
    assert m.allocate_slots(a, 10) is not None
    assert a.num_computed_tokens == 0  # the manager only reads it
    a.num_computed_tokens = 10  # the scheduler's part, after the step
    a.append_output_token_ids([10, 11, 12])
    assert m.append_slots(a, 3) == [m.block_pool.blocks[3]]  # tokens 10..12: a 4th block
    assert a.num_computed_tokens == 10
    a.num_computed_tokens = 13
    blocks, hit = m.get_computed_blocks(b := Request("b", list(range(13))))
    assert hit == 12  # the blocks the manager cached from the scheduler's count
    assert m.allocate_slots(b, 1, blocks) is not None and b.num_computed_tokens == 0


def test_allocate_counts_what_the_scheduler_already_computed() -> None:
    # the seed's formula: request.num_computed_tokens + hit blocks + new tokens
    m = make()
    a = Request("a", list(range(12)))
    a.num_computed_tokens = 4
    assert len(m.allocate_slots(a, 8) or []) == 3
    before = snapshot(m, ["a"])
    b = Request("b", list(range(12)))
    b.num_computed_tokens = 8
    with pytest.raises(ValueError, match="slots for 16 asked"):
        m.allocate_slots(b, 8)
    assert snapshot(m, ["a", "b"]) == before


def test_freeing_a_request_without_blocks_does_nothing() -> None:
    # a scheduler frees a request aborted while still waiting (never allocated)
    m = make()
    before = snapshot(m, ["w"])
    m.free(Request("w", list(range(8))))
    assert snapshot(m, ["w"]) == before
    a = Request("a", list(range(8)))
    allocate(m, a, 8)
    m.free(a)
    after = snapshot(m, ["a"])
    m.free(a)  # twice: the second is nothing to do, as in the seed
    assert snapshot(m, ["a"]) == after


def test_append_slots_of_zero_tokens_adds_nothing() -> None:
    m = make()
    a = Request("a", list(range(6)))
    allocate(m, a, 6)
    before = snapshot(m, ["a"])
    assert m.append_slots(a, 0) == []
    assert snapshot(m, ["a"]) == before


def test_caching_disabled_frees_in_table_order() -> None:
    # the seed frees forward without caching (no cached tail to keep longer), so
    # the next allocation gets the same block ids as on vLLM
    m = make(num_blocks=4, enable_caching=False)
    a = Request("a", list(range(12)))
    assert [b.block_id for b in allocate(m, a, 12) or []] == [0, 1, 2]
    m.free(a)
    b = Request("b", list(range(16)))
    assert [blk.block_id for blk in allocate(m, b, 16) or []] == [3, 0, 1, 2]
    cached = make(num_blocks=4)
    a = Request("a", list(range(12)))
    allocate(cached, a, 12)
    cached.free(a)
    b = Request("b", list(range(100, 116)))
    assert [blk.block_id for blk in allocate(cached, b, 16) or []] == [3, 2, 1, 0]
