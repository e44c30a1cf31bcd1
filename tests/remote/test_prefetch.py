"""Lookups that carry blocks (`kvtier.remote.prefetch`), in a real Redis: a one-worker
engine's lookup reads its first blocks whole and the load that follows takes them without
a round trip; nobody else's lookups read a byte they would not use; nothing carried is
trusted; and the kept values stay within their bounds (a model-based test)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.remote import prefetch, redis_store
from kvtier.remote.head_keys import HeadKeyedStore
from kvtier.remote.head_shard import HeadShard, HeadShardKVStore
from kvtier.remote.prefetch import PrefetchedValues
from kvtier.remote.remote_manager import RemoteLoadStoreSpec
from kvtier.remote.tier import RemoteTier
from kvtier.store.protocol import BlockLoadError
from kvtier.types import BlockHash
from tests.remote.conftest import RedisServer
from tests.remote.test_head_keys import HEAD_BYTES, HEADS, SHARED, blocks, calls, row_layout


@pytest.fixture
def carried(monkeypatch: pytest.MonkeyPatch) -> PrefetchedValues:
    """This test's own process-wide values (stores built after it use them)."""
    values = PrefetchedValues()
    monkeypatch.setattr(redis_store, "PREFETCHED", values)
    return values


def one_worker(url: str) -> tuple[RemoteTier, HeadShardKVStore]:
    """An engine of one worker: its tier and the worker's store (which loads here)."""
    tier = RemoteTier.from_url(url, SHARED, block_size=16, heads=HEADS)
    return tier, tier.head_store(row_layout(HEADS), HeadShard.of_rank(HEADS, 1, 0))


def written(url: str, n: int) -> tuple[RemoteTier, HeadShardKVStore, list[BlockHash], list[bytes]]:
    """`one_worker`, with `n` blocks it wrote."""
    hashes, data = blocks(n)
    tier, worker = one_worker(url)
    worker.write_blocks(RemoteLoadStoreSpec(hashes), [memoryview(d) for d in data])
    return tier, worker, hashes, data


def head_store(tier: RemoteTier) -> HeadKeyedStore:
    assert isinstance(tier.store, HeadKeyedStore)
    return tier.store


def ask(tier: RemoteTier, hashes: list[BlockHash], fetch: int) -> list[int] | None:
    """As the asynchronous lookups ask: a question a block, in one round trip."""
    return head_store(tier).try_count_prefixes([[h] for h in hashes], None, fetch)


def load(worker: HeadShardKVStore, hashes: list[BlockHash]) -> list[bytes]:
    rows = [bytearray(HEADS * HEAD_BYTES) for _ in hashes]
    worker.read_blocks(RemoteLoadStoreSpec(hashes), [memoryview(r) for r in rows])
    return [bytes(r) for r in rows]


def test_a_lookup_carries_its_first_blocks_and_their_load_needs_no_round_trip(
    redis_server: RedisServer, carried: PrefetchedValues
) -> None:
    tier, worker, hashes, data = written(redis_server.url, 3)
    client = redis_server.client()
    client.config_resetstat()
    assert ask(tier, hashes, fetch=2) == [1, 1, 1]
    asked = calls(client)
    assert asked["get"] == 2 and asked["getrange"] == 1  # one round trip, two read whole
    assert head_store(tier).stats.prefetched_blocks == 2
    assert head_store(tier).prefetched_count(hashes) == 2
    client.config_resetstat()
    assert load(worker, hashes) == data
    assert calls(client) == {"mget": 1}  # the third block only
    assert head_store(tier).stats.prefetch_loaded_blocks == 2
    assert len(carried) == 0  # taken: a value serves one load
    assert ask(tier, hashes, fetch=3) == [1, 1, 1]
    client.config_resetstat()
    assert load(worker, hashes) == data
    assert calls(client) == {}  # every block carried: no round trip at all


def test_a_block_evicted_after_its_lookup_carried_it_still_loads(
    redis_server: RedisServer, carried: PrefetchedValues
) -> None:
    tier, worker, hashes, data = written(redis_server.url, 2)
    assert ask(tier, hashes, fetch=2) == [1, 1]
    redis_server.client().flushall()
    assert load(worker, hashes) == data


def test_a_lookup_carries_nothing_where_no_worker_here_loads_whole_blocks(
    redis_server: RedisServer, carried: PrefetchedValues
) -> None:
    """The replay tool, a scheduler whose workers are other processes, and a
    tensor-parallel worker (its heads are part of each value) read headers only."""
    tier, worker, hashes, data = written(redis_server.url, 2)
    del worker
    gc.collect()
    client = redis_server.client()
    client.config_resetstat()
    assert ask(tier, hashes, fetch=2) == [1, 1]
    assert "get" not in calls(client)
    two = RemoteTier.from_url(redis_server.url, SHARED, block_size=16, heads=HEADS, group_heads=2)
    shard = HeadShard.of_rank(HEADS, 2, 0)
    part = two.head_store(row_layout(shard.count), shard)
    part.write_blocks(RemoteLoadStoreSpec(hashes), [memoryview(d[: 2 * HEAD_BYTES]) for d in data])
    client.config_resetstat()
    assert ask(two, hashes, fetch=2) == [1, 1]
    assert "get" not in calls(client)
    assert len(carried) == 0 and head_store(two).stats.prefetched_blocks == 0
    assert head_store(two).prefetched_count(hashes) == 0


def test_a_carried_value_is_verified_at_load_like_any_other(
    redis_server: RedisServer, carried: PrefetchedValues
) -> None:
    tier, worker, hashes, _ = written(redis_server.url, 1)
    assert ask(tier, hashes, fetch=1) == [1]
    ((key, (value, at)),) = carried._values.items()
    carried._values[key] = (value[:-1] + bytes([value[-1] ^ 0xFF]), at)  # one bit flipped
    with pytest.raises(BlockLoadError):
        load(worker, hashes)
    assert head_store(tier).stats.corrupt_blocks == 1
    assert redis_server.client().exists(key) == 0  # dropped, as a corrupt value read there


def test_asynchronous_lookups_carry_what_the_connector_asks_and_a_load_says_so(
    redis_server: RedisServer, carried: PrefetchedValues
) -> None:
    tier, _worker, hashes, _ = written(redis_server.url, 4)
    manager = tier.manager(async_lookup=True)
    carrying: list[int] = []
    manager.fetch_with(lambda: 3, lambda n: carrying.append(n) or 0.0)
    try:
        with manager.held_lookups():
            for h in hashes:
                assert manager.lookup([h]) is None
        assert manager.wait_lookups(5.0)
        assert [manager.lookup([h]) for h in hashes] == [1, 1, 1, 1]
        assert carrying == [3]  # the carrying of three blocks is not the round trip's
        assert manager.prefetched(hashes) == 3
        spec = manager.prepare_load(hashes)
        assert isinstance(spec, RemoteLoadStoreSpec) and spec.prefetched == 3
        manager.reset_cache("epoch")  # a reset forgets what lookups carried
        assert manager.prefetched(hashes) == 0
    finally:
        manager.close()


def test_bad_bounds_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        PrefetchedValues(max_bytes=0)
    with pytest.raises(ValueError, match="max_age_s"):
        PrefetchedValues(max_age_s=0)
    with pytest.raises(ValueError, match="max_age_s"):
        PrefetchedValues(max_age_s=-1.0)


KEYS = [b"a:1", b"a:2", b"b:1", b"b:2"]


class PrefetchedMachine(RuleBasedStateMachine):
    """The kept values against a model: an ordered dict of (value, when kept), oldest
    first, dropped past the age and, oldest first, past the byte budget."""

    MAX_BYTES, MAX_AGE = 10, 5.0

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.values = PrefetchedValues(self.MAX_BYTES, self.MAX_AGE, lambda: self.now)
        self.model: dict[bytes, tuple[bytes, float]] = {}

    def _expire(self) -> None:
        self.model = {k: v for k, v in self.model.items() if self.now - v[1] <= self.MAX_AGE}

    @rule(key=st.sampled_from(KEYS), size=st.integers(0, 12), fill=st.binary(min_size=1))
    def put(self, key: bytes, size: int, fill: bytes) -> None:
        value = (fill * size)[:size]
        kept = self.values.put(key, value)
        assert kept == (size <= self.MAX_BYTES)
        if not kept:
            return
        self._expire()
        self.model.pop(key, None)
        while self.model and sum(len(v) for v, _ in self.model.values()) + size > self.MAX_BYTES:
            del self.model[next(iter(self.model))]
        self.model[key] = (value, self.now)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def take(self, keys: list[bytes]) -> None:
        self._expire()
        want: list[Any] = []
        for key in keys:
            held = self.model.pop(key, None)
            want.append(None if held is None else held[0])
        assert self.values.take(keys) == want

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def count(self, keys: list[bytes]) -> None:
        self._expire()
        assert self.values.count(keys) == sum(k in self.model for k in keys)

    @rule(seconds=st.sampled_from([0.5, 2.0, 5.0, 6.0]))
    def wait(self, seconds: float) -> None:
        self.now += seconds

    @precondition(lambda self: bool(self.model))
    @rule(base=st.sampled_from([b"a:", b"b:", b""]))
    def clear(self, base: bytes) -> None:
        self.values.clear(base)
        self.model = {k: v for k, v in self.model.items() if not k.startswith(base)}

    @invariant()
    def within_budget(self) -> None:
        assert self.values.held_bytes == sum(len(v) for v, _ in self.values._values.values())
        assert self.values.held_bytes <= self.MAX_BYTES


PrefetchedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30)
test_prefetched_values_against_model = PrefetchedMachine.TestCase


def test_a_store_served_here_is_served_while_it_lives() -> None:
    values = PrefetchedValues()
    values.serve(b"x:")
    values.serve(b"x:")
    values.unserve(b"x:")
    assert values.serves(b"x:")
    values.unserve(b"x:")
    assert not values.serves(b"x:")
    assert prefetch.PREFETCHED is not values
