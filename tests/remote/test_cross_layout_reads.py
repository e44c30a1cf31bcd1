"""Where a lookup found a block of another layout, its load reads there first: one round
trip for a worker, as a GET of its own values is, and a wrong or stale hint costs a round
trip, never a block (every read is verified as before)."""

from __future__ import annotations

import pytest

from kvtier.remote.head_codec import HeadGroup
from kvtier.remote.remote_manager import RemoteLoadStoreSpec, RemoteOffloadingManager
from kvtier.store.protocol import BlockLoadError
from kvtier.types import BlockHash
from tests.remote.conftest import RedisServer
from tests.remote.test_head_keys import (
    HEAD_BYTES,
    HEADS,
    Engine,
    blocks,
    calls,
    engine,
    head_store,
    row_layout,
    write,
)


def load(workers: Engine, spec: RemoteLoadStoreSpec, rank: int) -> list[bytes]:
    """One worker's rows of the blocks `spec` names."""
    tier, shard = workers[rank]
    rows = [bytearray(shard.count * HEAD_BYTES) for _ in spec.block_hashes]
    tier.head_store(row_layout(shard.count), shard).read_blocks(spec, [memoryview(r) for r in rows])
    return [bytes(r) for r in rows]


def heads_of(data: list[bytes], group: HeadGroup) -> list[bytes]:
    return [d[group.first * HEAD_BYTES : group.end * HEAD_BYTES] for d in data]


def planned(workers: Engine, hashes: list[BlockHash]) -> RemoteLoadStoreSpec:
    """The spec the scheduler's manager plans after its lookup found `hashes`."""
    manager = workers[0][0].manager()
    assert isinstance(manager, RemoteOffloadingManager)
    assert manager.lookup(hashes) == len(hashes)
    spec = manager.prepare_load(hashes)
    assert isinstance(spec, RemoteLoadStoreSpec)
    return spec


@pytest.mark.parametrize(("writers", "readers"), [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_a_block_of_another_layout_costs_its_worker_one_round_trip(
    redis_server: RedisServer, writers: int, readers: int
) -> None:
    hashes, data = blocks(3)
    write(engine(redis_server.url, writers), hashes, data)
    reader = engine(redis_server.url, readers)
    spec = planned(reader, hashes)
    assert spec.holders == [HEADS // writers] * 3  # (heads a value of the writer's grouping)
    client = redis_server.client()
    for rank, (tier, shard) in enumerate(reader):
        client.config_resetstat()
        assert load(reader, spec, rank) == heads_of(data, shard.group)
        ranges = calls(client)
        assert "mget" not in ranges and "get" not in ranges  # no GET that misses first
        # one read a source value; two where the heads are not the value's first
        sources = max(1, (HEADS // readers) // (HEADS // writers))
        first_heads = shard.first % (HEADS // writers) == 0
        assert ranges == {"getrange": 3 * sources * (1 if first_heads else 2)}
        assert tier.stats.missing_blocks == 0
    client.config_resetstat()
    unplanned = load(reader, RemoteLoadStoreSpec(hashes), 0)  # no hint: its own values first
    assert unplanned == heads_of(data, reader[0][1].group)
    assert calls(client)["mget"] == 1


def test_a_same_layout_load_stays_one_get_a_block(redis_server: RedisServer) -> None:
    hashes, data = blocks(3)
    two = engine(redis_server.url, 2)
    write(two, hashes, data)
    spec = planned(two, hashes)
    assert spec.holders is None  # found in its own grouping: nothing to tell
    client = redis_server.client()
    client.config_resetstat()
    assert load(two, spec, 1) == heads_of(data, two[1][1].group)
    assert calls(client) == {"mget": 1}


def test_a_stale_hint_falls_back_to_every_grouping(redis_server: RedisServer) -> None:
    """The block moved (the other layout's value evicted, this one's written since) or
    went (evicted everywhere): found where it is, or a miss, as without the hint."""
    hashes, data = blocks(3)
    one, two = engine(redis_server.url, 1), engine(redis_server.url, 2)
    write(one, hashes, data)
    spec = planned(two, hashes)
    client = redis_server.client()
    client.delete(head_store(one).group_key(hashes[0], HeadGroup(0, HEADS)))
    write(two, hashes[:1], data[:1])
    assert load(two, spec, 1) == heads_of(data, two[1][1].group)
    assert head_store(two).stats.missing_blocks == 0
    client.delete(*(head_store(two).group_key(hashes[0], g) for g in (HeadGroup(0, 2),)))
    with pytest.raises(BlockLoadError, match=r"heads 0\.\.1 not servable"):
        load(two, spec, 0)
    wrong = RemoteLoadStoreSpec(hashes[1:], holders=[1, 1])  # no values of one head there
    assert load(two, wrong, 0) == heads_of(data[1:], two[0][1].group)
    with pytest.raises(ValueError, match="1 holders for 2 blocks"):
        load(two, RemoteLoadStoreSpec(hashes[1:], holders=[1]), 0)


def test_a_corrupt_head_where_the_hint_points_is_a_miss(redis_server: RedisServer) -> None:
    hashes, data = blocks(2)
    one, two = engine(redis_server.url, 1), engine(redis_server.url, 2)
    write(one, hashes, data)
    spec = planned(two, hashes)
    key = head_store(one).group_key(hashes[1], HeadGroup(0, HEADS))
    client = redis_server.client()
    value = bytearray(client.get(key) or b"")
    value[-1] ^= 0xFF  # the last head: worker 1's
    client.set(key, bytes(value))
    assert load(two, spec, 0) == heads_of(data, two[0][1].group)  # its heads are fine
    with pytest.raises(BlockLoadError, match="not servable"):
        load(two, spec, 1)
    assert head_store(two[1:]).stats.corrupt_blocks == 1
    assert client.get(key) is None  # dropped: every worker's next lookup stops before it
    assert two[0][0].manager().lookup(hashes) == 1


def test_a_one_block_question_of_another_layout_costs_two_round_trips(
    redis_server: RedisServer,
) -> None:
    """vLLM asks block by block: the probe of other groupings answers such a question,
    with no walk after it."""
    hashes, data = blocks(4)
    write(engine(redis_server.url, 1), hashes, data)
    store = head_store(engine(redis_server.url, 2))
    before = store.lookup_round_trips
    assert store.try_count_prefixes([[h] for h in hashes]) == [1, 1, 1, 1]
    assert store.lookup_round_trips - before == 2
    assert store.holders_of(hashes) == [HEADS] * 4
    before = store.lookup_round_trips
    assert store.try_count_prefixes([hashes]) == [4]  # a longer one walks on
    assert store.lookup_round_trips - before == 3


def test_the_grouping_told_is_read_before_its_own_values(redis_server: RedisServer) -> None:
    """Both layouts hold the block, this worker's own value is corrupt: told where the
    lookup found it, the worker reads there and never reads (nor drops) its own."""
    hashes, data = blocks(1)
    one, two = engine(redis_server.url, 1), engine(redis_server.url, 2)
    write(one, hashes, data)
    write(two, hashes, data)
    client = redis_server.client()
    own = head_store(two).group_key(hashes[0], HeadGroup(2, 2))
    value = bytearray(client.get(own) or b"")
    value[-1] ^= 0xFF  # head 3, this worker's last
    client.set(own, bytes(value))
    told = RemoteLoadStoreSpec(hashes, holders=[HEADS])
    assert load(two, told, 1) == heads_of(data, HeadGroup(2, 2))
    assert client.exists(own) and head_store(two[1:]).stats.corrupt_blocks == 0
    assert load(two, RemoteLoadStoreSpec(hashes), 1) == heads_of(data, HeadGroup(2, 2))
    assert not client.exists(own)  # read first without the hint: refused and dropped
    assert head_store(two[1:]).stats.corrupt_blocks == 1
