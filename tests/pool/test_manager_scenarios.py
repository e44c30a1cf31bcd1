"""Scenario tests of the seed behaviour (docs/semantics.md section 2)."""

from __future__ import annotations

import pytest

from kvtier import Request
from kvtier.gpu import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.hashing import hash_request_blocks
from tests.pool.helpers import allocate, append, make, snapshot


def run_prefill(manager, request):  # type: ignore[no-untyped-def]
    blocks, num_computed = manager.get_computed_blocks(request)
    new = allocate(manager, request, request.num_tokens - num_computed, blocks)
    return blocks, num_computed, new


def test_prefix_hit_across_requests() -> None:
    m = make()
    a = Request("a", list(range(16)))
    _, hit, new = run_prefill(m, a)
    assert hit == 0 and [b.block_id for b in new] == [0, 1, 2, 3]
    b = Request("b", [*range(10), 99, 99, 99, 99, 99, 99])
    blocks, hit, new = run_prefill(m, b)
    assert [x.block_id for x in blocks] == [0, 1] and hit == 8
    assert m.get_block_ids("b") == [0, 1, 4, 5]
    assert [m.block_pool.blocks[i].ref_cnt for i in range(6)] == [2, 2, 1, 1, 1, 1]
    assert m.get_num_common_prefix_blocks(a, 2) == 2
    assert m.get_num_common_prefix_blocks(a, 1) == 0
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queried_tokens, stats.hit_tokens) == (2, 32, 8)
    assert (stats.queried_blocks, stats.hit_blocks) == (8, 2)
    assert m.prefix_cache_stats.requests == 0


def test_at_least_one_token_is_computed() -> None:
    m = make()
    run_prefill(m, Request("a", list(range(16))))
    same, hit, _ = run_prefill(m, Request("b", list(range(16))))
    assert hit == 12 and len(same) == 3  # 4 full blocks cached, capped to 15 tokens
    longer = Request("c", list(range(17)))
    blocks, hit = m.get_computed_blocks(longer)
    assert hit == 16 and len(blocks) == 4


def test_free_is_tail_first_and_eviction_follows_the_queue() -> None:
    m = make(num_blocks=6)
    a = Request("a", list(range(16)))
    run_prefill(m, a)
    a_hashes = list(a.block_hashes)
    m.take_events()
    m.free(a)
    assert [b.block_id for b in m.block_pool.free_block_queue] == [4, 5, 3, 2, 1, 0]
    # 4 new blocks: the two never-used ones, then A's tail block 3, then block 2.
    run_prefill(m, Request("x", [7] * 13))
    assert m.get_block_ids("x") == [4, 5, 3, 2]
    removed = [e.block_hashes[0] for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [a_hashes[3], a_hashes[2]]
    blocks, hit = m.get_computed_blocks(Request("again", list(range(16))))
    assert [b.block_id for b in blocks] == [0, 1] and hit == 8


def test_only_reference_count_zero_blocks_are_evicted() -> None:
    m = make(num_blocks=6)
    running = Request("run", list(range(12)))
    run_prefill(m, running)
    done = Request("done", [50 + i for i in range(8)])
    run_prefill(m, done)
    m.free(done)
    m.take_events()
    big = Request("big", [9] * 12)  # needs 3 blocks: 1 never used + done's 2
    run_prefill(m, big)
    removed = {e.block_hashes[0] for e in m.take_events() if isinstance(e, BlockRemoved)}
    assert removed == set(done.block_hashes)
    assert all(m.is_cached(h) for h in running.block_hashes)
    assert allocate(m, Request("more", [1] * 4), 4) is None  # nothing free left


def test_failed_allocation_changes_nothing() -> None:
    m = make(num_blocks=4)
    a = Request("a", list(range(8)))
    run_prefill(m, a)
    m.free(a)  # queue [2, 3, 1, 0], blocks 0 and 1 cached
    m.take_events()
    b = Request("b", [*range(8), *[5] * 9])  # hits 2 evictable blocks, needs 3 new
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8
    before = snapshot(m, ["a", "b"])
    assert allocate(m, b, b.num_tokens - hit, blocks) is None
    assert snapshot(m, ["a", "b"]) == before
    assert m.take_events() == [] and b.num_computed_tokens == 0
    fits = Request("c", [*range(8), *[5] * 7])  # needs 2 new: exactly the 2 others
    blocks, hit = m.get_computed_blocks(fits)
    assert allocate(m, fits, fits.num_tokens - hit, blocks) is not None
    assert m.num_free_blocks == 0


def test_append_failure_changes_nothing() -> None:
    m = make(num_blocks=2)
    a = Request("a", list(range(8)))
    run_prefill(m, a)
    a.append_output_token_ids(1)
    before = snapshot(m, ["a"])
    assert append(m, a, 1) is None
    assert snapshot(m, ["a"]) == before and a.num_computed_tokens == 8


def test_events_in_order() -> None:
    m = make(num_blocks=3, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5], lora_name="ad")
    run_prefill(m, a)
    a.append_output_token_ids(6)
    append(m, a, 1)  # block 2 becomes full
    h = list(a.block_hashes)
    m.free(a)
    x = Request("x", [7, 7, 7])
    run_prefill(m, x)  # evicts the tail block (2), then block 1
    m.free(x)
    assert m.reset_prefix_cache()
    assert m.take_events() == [
        BlockStored((h[0], h[1]), None, (1, 2, 3, 4), 2, "ad"),
        BlockStored((h[2],), h[1], (5, 6), 2, "ad"),
        BlockRemoved((h[2],)),
        BlockRemoved((h[1],)),
        BlockStored(tuple(x.block_hashes), None, (7, 7), 2, None),
        AllBlocksCleared(),
    ]
    assert m.take_events() == []


def test_reset_prefix_cache_only_when_idle() -> None:
    m = make()
    a = Request("a", list(range(8)))
    run_prefill(m, a)
    assert not m.reset_prefix_cache()
    assert m.is_cached(a.block_hashes[0])
    m.free(a)
    assert m.reset_prefix_cache()
    assert not m.is_cached(a.block_hashes[0])
    assert m.get_computed_blocks(Request("b", list(range(9)))) == ([], 0)


def test_preempted_request_hits_its_own_cache() -> None:
    m = make()
    a = Request("a", list(range(10)))
    run_prefill(m, a)
    a.append_output_token_ids([10, 11])
    append(m, a, 2)
    m.preempt(a)
    assert a.num_computed_tokens == 0 and a.num_preemptions == 1
    assert not m.has_request("a") and m.num_free_blocks == 10
    blocks, hit = m.get_computed_blocks(a)
    assert hit == 8  # 12 tokens, 3 full blocks cached, capped to 11 tokens
    assert allocate(m, a, a.num_tokens - hit, blocks) is not None
    assert m.prefix_cache_stats.preempted_requests == 1


def test_preallocation_and_decode_without_new_blocks() -> None:
    m = make(num_preallocate_tokens=8)
    a = Request("a", list(range(5)))
    new = allocate(m, a, 5)
    assert new is not None and len(new) == 2 + 2
    for token in range(11):
        a.append_output_token_ids(token)
        assert append(m, a, 1) == []
    a.append_output_token_ids(0)
    assert len(append(m, a, 1) or []) == 3  # 1 needed + 2 preallocated
    capped = make(num_preallocate_tokens=64, max_model_len=12)
    assert len(allocate(capped, Request("c", [1] * 5), 5) or []) == 3


def test_hash_built_requests_behave_like_token_requests() -> None:
    def replay(use_hashes: bool) -> list[object]:
        m = make(num_blocks=12)
        trace = []
        prompts = [list(range(14)), [*range(9), 70, 71, 72], list(range(14)), [3] * 10]
        for i, prompt in enumerate(prompts):
            if use_hashes:
                hashes = hash_request_blocks(prompt, 4)
                r = Request.from_block_hashes(f"r{i}", hashes, len(prompt), block_size=4)
            else:
                r = Request(f"r{i}", prompt)
            _, hit, _ = run_prefill(m, r)
            trace.append((hit, m.get_block_ids(r.request_id), m.get_num_cached_blocks(f"r{i}")))
            if i % 2:
                m.free(r)
        return trace

    assert replay(True) == replay(False)


def test_hash_built_request_output_blocks_get_no_hash() -> None:
    m = make()
    r = Request.from_block_hashes("t", hash_request_blocks(range(6), 4), 6, block_size=4)
    run_prefill(m, r)
    r.append_output_token_ids([1, 2, 3])
    append(m, r, 3)
    assert r.num_computed_tokens == 9 and m.get_num_cached_blocks("t") == 1


def test_duplicate_blocks_are_kept_and_found_in_caching_order() -> None:
    m = make(num_blocks=4)
    a, b = Request("a", list(range(8))), Request("b", list(range(8)))
    allocate(m, a, 8)
    allocate(m, b, 8)  # no prefix reuse asked: identical blocks, not de-duplicated
    assert m.get_block_ids("b") == [2, 3]
    assert m.block_pool.get_cached_block(a.block_hashes[0]).block_id == 0  # type: ignore[union-attr]
    m.free(a)
    allocate(m, Request("x", [5] * 8), 8)  # evicts a's copies, b's stay
    blocks, hit = m.get_computed_blocks(Request("c", list(range(9))))
    assert [x.block_id for x in blocks] == [2, 3] and hit == 8


def test_repeated_hashes_in_one_request_reuse_one_block_twice() -> None:
    # Hash-built requests may repeat a hash; the hit then holds one block twice, which
    # must leave the free queue once (the pool's count once broke here).
    m = make(num_blocks=10)
    hashes = [*hash_request_blocks(range(4), 4)] * 2
    a = Request.from_block_hashes("a", hashes, 9, block_size=4)
    run_prefill(m, a)
    m.free(a)
    b = Request.from_block_hashes("b", hashes, 9, block_size=4)
    blocks, hit, _ = run_prefill(m, b)
    assert hit == 8 and blocks[0] is blocks[1] and blocks[0].ref_cnt == 2
    assert m.num_free_blocks == len(list(m.block_pool.free_block_queue)) == 8
    m.free(b)
    assert m.num_free_blocks == len(list(m.block_pool.free_block_queue)) == 10


def test_on_evict_hook_sees_each_evicted_hash() -> None:
    seen: list[bytes] = []
    m = make(num_blocks=3, on_evict=seen.append, enable_kv_cache_events=False)
    a = Request("a", list(range(8)))
    run_prefill(m, a)
    m.free(a)
    run_prefill(m, Request("x", [1] * 12))
    assert seen == [a.block_hashes[1], a.block_hashes[0]]
    assert m.take_events() == []


def test_caching_disabled() -> None:
    m = make(enable_caching=False)
    a = Request("a", list(range(8)))
    run_prefill(m, a)
    assert m.get_computed_blocks(Request("b", list(range(9)))) == ([], 0)
    assert m.take_events() == [] and m.block_pool.num_cached_hashes == 0


class TestBadInput:
    def test_token_counts(self) -> None:
        m = make()
        a = Request("a", list(range(8)))
        for bad in (0, -3):
            with pytest.raises(ValueError, match="num_tokens must be an integer >= 1"):
                allocate(m, a, bad)
        allocate(m, a, 8)
        before = snapshot(m, ["a"])
        with pytest.raises(ValueError, match="num_tokens must be an integer >= 0, got -1"):
            append(m, a, -1)
        assert append(m, a, 0) == []  # the seed's answer: nothing to add
        with pytest.raises(ValueError, match="append its tokens first"):
            append(m, a, 1)
        assert snapshot(m, ["a"]) == before and a.num_computed_tokens == 8

    def test_longer_than_max_model_len(self) -> None:
        m = make(max_model_len=10)
        before = snapshot(m, [])
        too_long = Request("a", list(range(11)))
        for chunk in (11, 4):  # even a first chunk: the request can never finish
            with pytest.raises(ValueError, match="max_model_len=10"):
                allocate(m, too_long, chunk)
        assert snapshot(m, []) == before
        a = Request("a", list(range(10)))
        allocate(m, a, 10)
        a.append_output_token_ids(1)
        with pytest.raises(ValueError, match="max_model_len"):
            append(m, a, 1)

    def test_unknown_request_and_double_free(self) -> None:
        m = make()
        a = Request("a", list(range(8)))
        for call in (lambda r: append(m, r, 1), m.preempt):
            with pytest.raises(KeyError, match="never allocated, or already freed"):
                call(a)
        assert a.num_preemptions == 0
        with pytest.raises(KeyError):
            m.get_num_common_prefix_blocks(a, 1)
        allocate(m, a, 8)
        with pytest.raises(ValueError, match="already has blocks"):
            allocate(m, a, 8)
        m.free(a)
        before = snapshot(m, ["a"])
        m.free(a)  # as the seed: freeing a request without blocks does nothing
        assert snapshot(m, ["a"]) == before

    def test_stale_computed_blocks(self) -> None:
        m = make(num_blocks=3)
        a = Request("a", list(range(8)))
        allocate(m, a, 8)
        m.free(a)
        b = Request("b", list(range(9)))
        blocks, _ = m.get_computed_blocks(b)
        allocate(m, Request("x", [1] * 12), 12)  # evicts a's blocks
        before = snapshot(m, ["b", "x"])
        with pytest.raises(ValueError, match="does not hold request 'b'"):
            allocate(m, b, 1, blocks)
        assert snapshot(m, ["b", "x"]) == before

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"block_size": 0}, "block_size"),
            ({"num_blocks": 0}, "num_gpu_blocks"),
            ({"max_model_len": 0}, "max_model_len"),
            ({"sliding_window": 0}, "sliding_window"),
            ({"num_preallocate_tokens": -1}, "num_preallocate_tokens"),
            ({"hash_algorithm": "md5"}, "unknown hash algorithm"),
        ],
    )
    def test_bad_configuration(self, kwargs: dict[str, object], message: str) -> None:
        with pytest.raises(ValueError, match=message):
            make(**kwargs)  # type: ignore[arg-type]
