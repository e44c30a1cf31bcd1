"""Blocks kept by KV head in a real Redis: written under one tensor-parallel layout, read
under another; a missing or corrupt head is a miss for the whole block."""

from __future__ import annotations

import random

import pytest

from kvtier.remote.head_keys import HeadKeyedStore, HeadShard, head_hashes, split_heads
from kvtier.remote.remote_manager import RemoteLoadStoreSpec
from kvtier.remote.tier import RemoteTier
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError
from kvtier.types import BlockHash
from tests.remote.conftest import RedisServer

HEADS = 4
HEAD_BYTES = 256  # one head of one block: every layer's K and V
SHARED = KVLayout(num_layers=2, num_kv_heads=1, head_size=4, block_size=16, dtype="uint8")


def row_layout(count: int) -> KVLayout:
    """A worker's row: `count` heads one after the other."""
    return KVLayout(num_layers=2 * count, num_kv_heads=1, head_size=2, block_size=16, dtype="uint8")


def blocks(n: int, seed: int = 0) -> tuple[list[BlockHash], list[bytes]]:
    """`n` chained hashes and each block's bytes of all HEADS heads."""
    rng = random.Random(seed)
    hashes = [BlockHash(rng.randbytes(32)) for _ in range(n)]
    return hashes, [rng.randbytes(HEADS * HEAD_BYTES) for _ in range(n)]


def engine(url: str, workers: int) -> Engine:
    """One tier per worker of an engine of `workers` tensor-parallel workers."""
    shards = [HeadShard.of_rank(HEADS, workers, rank) for rank in range(workers)]
    return [(RemoteTier.from_url(url, SHARED, block_size=16, heads=HEADS), s) for s in shards]


Engine = list[tuple[RemoteTier, HeadShard]]


def write(workers: Engine, hashes: list[BlockHash], data: list[bytes]) -> None:
    for tier, shard in workers:
        store = tier.head_store(row_layout(shard.count), shard)
        rows = [
            memoryview(block[shard.first * HEAD_BYTES : (shard.first + shard.count) * HEAD_BYTES])
            for block in data
        ]
        store.write_blocks(RemoteLoadStoreSpec(hashes), rows)


def read(workers: Engine, hashes: list[BlockHash]) -> list[bytes]:
    """Every block as the engine's workers load it, their heads joined again."""
    parts: list[list[bytes]] = [[] for _ in hashes]
    for tier, shard in workers:
        store = tier.head_store(row_layout(shard.count), shard)
        rows = [bytearray(shard.count * HEAD_BYTES) for _ in hashes]
        store.read_blocks(RemoteLoadStoreSpec(hashes), [memoryview(r) for r in rows])
        for i, row in enumerate(rows):
            parts[i].append(bytes(row))
    return [b"".join(p) for p in parts]


@pytest.mark.parametrize(("writers", "readers"), [(2, 1), (1, 2), (4, 2), (2, 4), (1, 4)])
def test_any_layout_reads_what_another_wrote(
    redis_server: RedisServer, writers: int, readers: int
) -> None:
    hashes, data = blocks(5)
    writer, reader = engine(redis_server.url, writers), engine(redis_server.url, readers)
    assert reader[0][0].manager().lookup(hashes) == 0
    write(writer, hashes, data)
    assert reader[0][0].manager().lookup(hashes) == 5
    assert read(reader, hashes) == data
    # a block is one value per head whatever wrote it: as many keys as one layout writes
    assert redis_server.client().dbsize() == 5 * HEADS


def test_a_missing_head_is_a_miss_for_every_worker(redis_server: RedisServer) -> None:
    hashes, data = blocks(4)
    two = engine(redis_server.url, 2)
    write(two, hashes, data)
    tier = two[0][0]
    store = tier.store
    assert isinstance(store, HeadKeyedStore)
    # Redis evicted the last head of block 2 (or its worker's write failed)
    redis_server.client().delete(store.key(head_hashes([hashes[2]], range(HEADS - 1, HEADS))[0]))
    assert tier.manager().lookup(hashes) == 2  # every worker stops at block 2
    one = engine(redis_server.url, 1)
    assert one[0][0].manager().lookup(hashes) == 2
    with pytest.raises(BlockLoadError, match="head 3 not servable"):
        read(one, hashes)
    assert read(one, hashes[:2]) == data[:2]


def test_a_corrupt_head_fails_its_load_and_is_dropped(redis_server: RedisServer) -> None:
    hashes, data = blocks(3)
    two = engine(redis_server.url, 2)
    write(two, hashes, data)
    store = two[1][0].store
    key = store.key(head_hashes([hashes[1]], range(2, 3))[0])
    client = redis_server.client()
    value = bytearray(client.get(key) or b"")
    value[-1] ^= 0xFF
    client.set(key, bytes(value))
    with pytest.raises(BlockLoadError, match="head 2"):
        read(two[1:], hashes)  # the worker holding heads 2 and 3
    assert store.stats.corrupt_blocks == 1
    assert client.get(key) is None  # deleted: the next lookup stops before it
    assert two[0][0].manager().lookup(hashes) == 1
    assert read(two, hashes[:1]) == data[:1]


def test_replicated_heads_are_written_once_and_read_by_all(redis_server: RedisServer) -> None:
    """Fewer KV heads than workers: four workers, two heads, each head held by two."""
    shards = [HeadShard.of_rank(2, 4, rank) for rank in range(4)]
    assert [(s.first, s.writes) for s in shards] == [(0, True), (0, False), (1, True), (1, False)]
    hashes = [BlockHash(bytes([i]) * 32) for i in range(3)]
    per_head = {h: [bytes([h + 1]) * 64 for _ in hashes] for h in range(2)}
    tiers = [RemoteTier.from_url(redis_server.url, SHARED, block_size=16, heads=2) for _ in shards]
    stores = [t.head_store(row_layout(1), s) for t, s in zip(tiers, shards, strict=True)]
    client = redis_server.client()
    for store, shard in zip(stores[1::2], shards[1::2], strict=True):  # the replicas
        rows = [memoryview(v) for v in per_head[shard.first]]
        store.write_blocks(RemoteLoadStoreSpec(hashes), rows)
    assert client.dbsize() == 0  # a replica writes nothing
    for store, shard in zip(stores[::2], shards[::2], strict=True):
        rows = [memoryview(v) for v in per_head[shard.first]]
        store.write_blocks(RemoteLoadStoreSpec(hashes), rows)
    assert client.dbsize() == 2 * len(hashes)  # one copy of each head
    for store, shard in zip(stores, shards, strict=True):
        rows = [bytearray(64) for _ in hashes]
        store.read_blocks(RemoteLoadStoreSpec(hashes), [memoryview(r) for r in rows])
        assert [bytes(r) for r in rows] == per_head[shard.first]


def test_whole_block_calls_cut_and_join_the_heads(redis_server: RedisServer) -> None:
    hashes, data = blocks(3)
    tier = RemoteTier.from_url(redis_server.url, SHARED, block_size=16, heads=HEADS)
    assert tier.store.store(hashes[:2], data[:2])
    assert tier.store.try_count_prefixes([hashes]) == [2]  # one question, or several
    assert tier.store.try_count_prefixes([hashes, hashes[:1], hashes[2:]]) == [2, 1, 0]
    assert tier.store.store(hashes[2:], data[2:])
    assert [bytes(v) if v is not None else None for v in tier.store.load(hashes)] == data
    assert read(engine(redis_server.url, 4), hashes) == data


def test_another_fingerprint_never_reads_the_heads(redis_server: RedisServer) -> None:
    hashes, data = blocks(2)
    write(engine(redis_server.url, 2), hashes, data)
    other = RemoteTier.from_url(redis_server.url, "another model", block_size=16, heads=HEADS)
    assert other.manager().lookup(hashes) == 0
    whole = RemoteTier.from_url(redis_server.url, SHARED, block_size=16)  # one value a block
    assert whole.manager().lookup(hashes) == 0


def test_shards_of_rank() -> None:
    assert HeadShard.of_rank(8, 2, 1) == HeadShard(8, 4, 4)
    assert HeadShard.of_rank(2, 1, 0) == HeadShard(2, 0, 2)
    assert HeadShard.of_rank(1, 2, 1) == HeadShard(1, 0, 1, writes=False)  # MLA-style
    with pytest.raises(ValueError, match="3 KV heads do not divide among 2"):
        HeadShard.of_rank(3, 2, 0)
    with pytest.raises(ValueError, match="rank 2 is not one of 2"):
        HeadShard.of_rank(4, 2, 2)
    with pytest.raises(ValueError, match="not among the model's 4"):
        HeadShard(4, 3, 2)
    with pytest.raises(ValueError, match="does not cut into 3 heads"):
        split_heads([b"abcd"], 3)
