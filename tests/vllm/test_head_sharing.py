"""Redis blocks kept by KV head (`engine_shape.head_sharing`), in process: engines of
different tensor-parallel sizes read each other's blocks, each worker exactly its heads;
a missing or corrupt head is a miss for every worker; layouts that cannot share are kept
apart. (`test_engine_parallel` plays the same in real vLLM engines.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.remote.conftest import RedisServer, serve_redis
from tests.vllm.needs_vllm import quiet
from tests.vllm.parallel_engine import HEAD_PAGE, LAYERS, ParallelEngine, config, keys_of

with quiet():
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalPageMapping,
        CopyRun,
        ReqContext,
    )

    from kvtier.remote.head_shard import HeadShard
    from kvtier.vllm.offloading.engine_shape import check_head_major, head_sharing

HEADS = 2


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    servers = serve_redis(tmp_path)
    yield next(servers)
    next(servers, None)


def engine(engines: list[Any], url: str, tp: int, kv_heads: int = HEADS) -> ParallelEngine:
    extra = {"cpu_bytes_to_use": 2 * LAYERS * HEAD_PAGE * kv_heads, "redis_url": url}
    made = ParallelEngine(extra, tp=tp, kv_heads=kv_heads)
    engines.append(made)
    return made


def whole(engine: ParallelEngine, device_id: int) -> bytes:
    """A block as one worker holding every head would: each layer's page, its ranks'
    parts (their heads) one after the other."""
    return b"".join(
        engine.pages[rank][layer][device_id].numpy().tobytes()
        for layer in range(LAYERS)
        for rank in range(len(engine.pages))
    )


def found(engine: ParallelEngine, keys: list[bytes]) -> list[bool]:
    engine.hits(keys)  # asked asynchronously: the answers come on a later ask
    assert engine.manager.remote.wait_lookups(timeout=30)
    return engine.hits(keys)


@pytest.mark.parametrize(("writers", "readers"), [(2, 1), (1, 2)])
def test_an_engine_reads_the_blocks_of_another_parallel_layout(
    engines: list[Any], redis: RedisServer, writers: int, readers: int
) -> None:
    writer = engine(engines, redis.url, writers)
    keys = keys_of(3)
    writer.compute([0, 1, 2], seed=writers)
    assert not writer.store(keys, [0, 1, 2])
    # one value per block and worker, and the set naming the writer's grouping
    assert redis.client().dbsize() == 3 * writers + 1

    reader = engine(engines, redis.url, readers)
    assert found(reader, keys) == [True] * 3
    errors, report = reader.load(keys, [8, 9, 10])
    assert not errors and not report
    assert [whole(reader, i) for i in (8, 9, 10)] == [whole(writer, i) for i in (0, 1, 2)]


@pytest.mark.parametrize(("writers", "readers"), [(2, 1), (1, 2)])
def test_blocks_kept_by_head_are_sent_from_the_cpu_slots(
    engines: list[Any], redis: RedisServer, writers: int, readers: int
) -> None:
    """A store's blocks that its CPU part copies into CPU slots go to Redis from those
    slots, each value the slot's runs in head order (`handlers.slot_order`), with no copy
    on the engine's thread (`StagedHandler.snapshot`, which took 10-20 ms of each
    32-block store there); another layout reads them whole."""
    extra = {"cpu_bytes_to_use": 8 * LAYERS * HEAD_PAGE * HEADS, "redis_url": redis.url}
    writer = ParallelEngine(extra, tp=writers, kv_heads=HEADS)
    engines.append(writer)
    for worker in writer.workers:
        assert worker._slot_order is not None

        def refused(device_ids: Any) -> None:
            raise AssertionError("a Redis store of blocks in the CPU slots was copied")

        worker._stager.snapshot = refused
    keys = keys_of(3)
    writer.compute([0, 1, 2], seed=11)
    assert not writer.store(keys, [0, 1, 2])
    reader = engine(engines, redis.url, readers)
    assert found(reader, keys) == [True] * 3
    errors, report = reader.load(keys, [8, 9, 10])
    assert not errors and not report
    assert [whole(reader, i) for i in (8, 9, 10)] == [whole(writer, i) for i in (0, 1, 2)]


def test_a_corrupt_head_on_one_worker_is_recomputed_on_all(
    engines: list[Any], redis: RedisServer
) -> None:
    writer = engine(engines, redis.url, 1)
    keys = keys_of(3)
    writer.compute([0, 1, 2], seed=7)
    writer.store(keys, [0, 1, 2])
    client = redis.client()
    (key,) = [k for k in client.keys("*") if k.endswith(keys[1][:-4].hex().encode() + b"}")]
    value = bytearray(client.get(key) or b"")
    value[-1] ^= 0xFF  # the last byte of block 1 is head 1's: what worker 1 of two loads
    client.set(key, bytes(value))

    reader = engine(engines, redis.url, 2)
    assert found(reader, keys) == [True] * 3  # a lookup reads headers, not payloads
    errors, report = reader.load(keys, [8, 9, 10])
    assert errors == {8, 9, 10}  # worker 1's part failed: vLLM recomputes it on both
    assert report.remote_corrupt == 1
    assert client.get(key) is None  # dropped: never offered again
    # the request that loaded them recomputes them; another asks block by block and
    # loads up to the first miss
    assert found(reader, keys) == [False] * 3
    reader.ctx = ReqContext(req_id="another request")
    assert found(reader, keys) == [True, False, True]
    assert found(engine(engines, redis.url, 1), keys) == [True, False, True]


def test_heads_every_worker_holds_are_written_once_and_read_by_all(
    engines: list[Any], redis: RedisServer
) -> None:
    """One KV head and two workers (MLA-style: every worker holds the same bytes)."""
    writer = engine(engines, redis.url, 2, kv_heads=1)
    writer.compute([0, 1], seed=9)
    for layer in range(LAYERS):  # both workers hold the same head
        writer.pages[1][layer].copy_(writer.pages[0][layer])
    keys = keys_of(2)
    assert not writer.store(keys, [0, 1])
    assert redis.client().dbsize() == 2 + 1  # one copy, and the grouping named
    stored = [worker.remote_tier.stats.stored_blocks for worker in writer.workers]
    assert stored == [2, 0]  # written once: the second worker sends nothing
    for readers in (1, 2):
        reader = engine(engines, redis.url, readers, kv_heads=1)
        assert found(reader, keys) == [True, True]
        errors, _ = reader.load(keys, [8, 9])
        assert not errors
        for rank in range(readers):
            assert [reader.shard(rank, i) for i in (8, 9)] == [writer.shard(0, i) for i in (0, 1)]


def sharing(tp: int = 2, rank: int = 0, heads: int | None = HEADS, **shape: Any) -> Any:
    shape.setdefault("kv_cache_layout", "LBHNC")
    count = HeadShard.of_rank(heads, tp, rank).count if heads and heads % tp == 0 else 1
    made = config({}, tp=tp, rank=rank, kv_bytes_per_block=LAYERS * count * HEAD_PAGE, **shape)
    return head_sharing(made, heads)


def test_blocks_are_named_by_what_they_are_not_by_who_wrote_them() -> None:
    one = sharing(tp=1)
    rank0, rank1 = sharing(rank=0), sharing(rank=1)
    assert one.shared == rank0.shared == rank1.shared  # every layout reads every other's
    assert [s.shard.heads for s in (one, rank0, rank1)] == [range(2), range(1), range(1, 2)]
    assert one.row.bytes_per_block == 2 * rank0.row.bytes_per_block
    others = [
        sharing(model="another-model"),
        sharing(groups=2),
        sharing(tokens_per_block=16),
        sharing(heads=4),
    ]
    base = dataclasses.replace(config({}, tp=2), kv_cache_layout="LBHNC")
    dtype = head_sharing(
        dataclasses.replace(
            base,
            model=dataclasses.replace(base.model, dtype="bfloat16"),
            worker_kv_bytes_per_block=LAYERS * HEAD_PAGE,
        ),
        HEADS,
    )
    fingerprints = {s.shared.fingerprint for s in [*others, dtype]}
    assert len(fingerprints) == 5 and one.shared.fingerprint not in fingerprints


def test_layouts_that_cannot_share_keep_their_own_keys() -> None:
    assert sharing(kv_cache_layout="LBNHC") is None  # heads interleaved per token
    assert sharing(kv_cache_layout=None) is None
    assert sharing(heads=None) is None  # the spec built outside KvtierConnector
    assert sharing(heads=3) is None  # three heads over two workers: not whole heads


def test_a_page_vllm_maps_otherwise_is_refused_at_start() -> None:
    rank1 = sharing(rank=1)
    page = HEAD_PAGE
    strided = CanonicalPageMapping(2 * page, page, (CopyRun(0, 64, 64, 16, 64, 128),), 1, 0, True)
    refs = [[CanonicalKVCacheRef(i, page, strided) for i in range(LAYERS)]]
    with pytest.raises(
        ValueError, match=r"LBHNC .* \(heads 1\.\.1 of 2\) .* not whole at byte 1024"
    ):
        check_head_major(CanonicalKVCaches([], refs), rank1, workers=2)
    whole_page = CanonicalPageMapping(
        2 * page, page, (CopyRun(0, page, page, 1, page, page),), 1, 0, True
    )
    check_head_major(CanonicalKVCaches([], [[CanonicalKVCacheRef(0, page, whole_page)]]), rank1, 2)
    with pytest.raises(ValueError, match="maps this worker"):
        check_head_major(CanonicalKVCaches([], [[CanonicalKVCacheRef(0, page)]]), rank1, 2)
