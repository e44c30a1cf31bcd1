"""Golden numbers on the real Mooncake trace (hash ids as 512-token blocks).

Each request: prefix lookup, allocation of its prompt, and a free once 16 newer requests
hold blocks (or earlier when the pool is short). With a pool larger than the trace the
hits must equal an independently computed infinite-cache count; the smaller pools pin
the eviction decisions (numbers printed by `benchmarks.bench_gpu` as `hits`).
"""

from __future__ import annotations

from collections import deque

import pytest

from kvtier import KVCacheManager, Request
from kvtier.sim.traces import TraceRequest
from kvtier.types import int_block_hash

BLOCK_SIZE = 512


def replay_hits(trace: list[TraceRequest], num_blocks: int, concurrency: int = 16) -> int:
    manager = KVCacheManager(BLOCK_SIZE, num_blocks, 200_000, num_preallocate_tokens=0)
    running: deque[Request] = deque()
    hits = 0
    for i, t in enumerate(trace):
        full = t.input_length // BLOCK_SIZE
        hashes = [int_block_hash(h) for h in t.hash_ids[:full]]
        request = Request.from_block_hashes(f"r{i}", hashes, t.input_length, block_size=BLOCK_SIZE)
        while True:
            blocks, hit = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, t.input_length - hit, blocks) is not None:
                hits += len(blocks)
                running.append(request)
                break
            assert running, f"request {i} does not fit an empty pool"
            manager.free(running.popleft())
        while len(running) > concurrency:
            manager.free(running.popleft())
    stats = manager.prefix_cache_stats
    assert stats.hit_blocks >= hits  # retries after a failed allocation query again
    return hits


def infinite_cache_hits(trace: list[TraceRequest]) -> int:
    seen: set[int] = set()
    hits = 0
    for t in trace:
        full = t.input_length // BLOCK_SIZE
        cap = (t.input_length - 1) // BLOCK_SIZE
        ids = t.hash_ids[:full]
        for block_id in ids[: min(full, cap)]:
            if block_id not in seen:
                break
            hits += 1
        seen.update(ids)
    return hits


def test_unbounded_pool_matches_infinite_cache(conversation_trace: list[TraceRequest]) -> None:
    expected = infinite_cache_hits(conversation_trace)
    assert expected > 80_000
    assert replay_hits(conversation_trace, 200_000) == expected


@pytest.mark.parametrize(("num_blocks", "hits"), [(1827, 15116), (18279, 80366)])
def test_bounded_pools(conversation_trace: list[TraceRequest], num_blocks: int, hits: int) -> None:
    assert replay_hits(conversation_trace, num_blocks) == hits
