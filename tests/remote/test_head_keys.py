"""Blocks kept by KV head group in a real Redis: written under one tensor-parallel layout,
read under another; a missing or corrupt head is a miss for the whole block; a layout
reading its own blocks pays one value per block and worker, as one value a block did."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvtier.remote.codec import HEADER_SIZE
from kvtier.remote.head_codec import HeadGroup, header_size
from kvtier.remote.head_keys import HeadKeyedStore, grouping, split_heads
from kvtier.remote.head_shard import HeadShard
from kvtier.remote.remote_manager import RemoteLoadStoreSpec
from kvtier.remote.tier import RemoteTier
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError
from kvtier.types import BlockHash
from tests.remote.conftest import RedisServer

HEADS = 4
HEAD_BYTES = 256  # one head of one block: every layer's K and V
SHARED = KVLayout(num_layers=2, num_kv_heads=1, head_size=4, block_size=16, dtype="uint8")
Engine = list[tuple[RemoteTier, HeadShard]]


def row_layout(count: int) -> KVLayout:
    """A worker's row: `count` heads one after the other."""
    return KVLayout(num_layers=2 * count, num_kv_heads=1, head_size=4, block_size=16, dtype="uint8")


def blocks(n: int, seed: int = 0) -> tuple[list[BlockHash], list[bytes]]:
    """`n` chained hashes and each block's bytes of all HEADS heads."""
    rng = random.Random(seed)
    hashes = [BlockHash(rng.randbytes(32)) for _ in range(n)]
    return hashes, [rng.randbytes(HEADS * HEAD_BYTES) for _ in range(n)]


def engine(url: str, workers: int, heads: int = HEADS) -> Engine:
    """One tier per worker of an engine of `workers` tensor-parallel workers."""
    shards = [HeadShard.of_rank(heads, workers, rank) for rank in range(workers)]
    return [
        (RemoteTier.from_url(url, SHARED, block_size=16, heads=heads, group_heads=s.count), s)
        for s in shards
    ]


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


def calls(client: Any) -> dict[str, int]:
    """Commands the server ran since its counters were reset, by name."""
    stats = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): row["calls"]
        for name, row in stats.items()
        if not name.startswith(("cmdstat_config", "cmdstat_info"))
    }


def head_store(workers: Engine) -> HeadKeyedStore:
    store = workers[0][0].store
    assert isinstance(store, HeadKeyedStore)
    return store


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
    # one value per block and worker of the writer, and the set naming its grouping; the
    # reader wrote nothing
    assert redis_server.client().dbsize() == 5 * writers + 1
    assert head_store(reader).stats.missing_blocks == 0  # found in the writer's grouping


def test_a_layout_reading_its_own_blocks_pays_what_one_value_a_block_did(
    redis_server: RedisServer,
) -> None:
    """Same number of values, keys of the same length, a 48-byte header for one head."""
    hashes, data = blocks(3)
    whole = RemoteTier.from_url(redis_server.url, SHARED, block_size=16)  # one value a block
    client = redis_server.client()
    for workers in (1, 2, 4):
        client.flushall()
        two = engine(redis_server.url, workers)
        write(two, hashes, data)
        assert client.dbsize() == 3 * workers + 1  # and the set naming the grouping
        for _, shard in two:
            key = head_store(two).group_key(hashes[0], shard.group)
            assert len(key) == len(whole.store.key(hashes[0]))
            value = client.get(key) or b""
            assert len(value) == header_size(shard.count) + shard.count * HEAD_BYTES
        client.config_resetstat()
        assert read(two, hashes) == data
        # one MGET a worker (one GET a block), no header or range reads
        assert calls(client) == {"mget": workers}
        # a lookup: the commands of one value a block (the prefix script)
        assert whole.store.store(hashes, data)
        assert whole.manager().lookup(hashes) == two[0][0].manager().lookup(hashes) == 3
        client.config_resetstat()
        assert whole.manager().lookup(hashes) == 3
        one_value_a_block = calls(client)
        client.config_resetstat()
        assert two[0][0].manager().lookup(hashes) == 3
        # every worker's value of each block, in one script call (an engine kept by
        # rank asked each worker's keys, a call each), which also reads the groupings
        # written (where none but this one was, a walk that stops is final)
        assert calls(client) == {"evalsha": 1, "getrange": 3 * workers, "smembers": 1}
        assert one_value_a_block == {"evalsha": 1, "getrange": 3}
    assert header_size(1) == HEADER_SIZE


def test_a_missing_head_is_a_miss_for_every_worker(redis_server: RedisServer) -> None:
    hashes, data = blocks(4)
    two = engine(redis_server.url, 2)
    write(two, hashes, data)
    tier = two[0][0]
    # Redis evicted heads 2 and 3 of block 2 (or their worker's write failed)
    redis_server.client().delete(head_store(two).group_key(hashes[2], HeadGroup(2, 2)))
    assert tier.manager().lookup(hashes) == 2  # every worker stops at block 2
    one = engine(redis_server.url, 1)
    assert one[0][0].manager().lookup(hashes) == 2
    with pytest.raises(BlockLoadError, match=r"heads 0\.\.3 not servable"):
        read(one, hashes)
    assert read(one, hashes[:2]) == data[:2]


def test_a_corrupt_head_fails_its_load_and_is_dropped(redis_server: RedisServer) -> None:
    hashes, data = blocks(3)
    one = engine(redis_server.url, 1)
    write(one, hashes, data)
    key = head_store(one).group_key(hashes[1], HeadGroup(0, HEADS))
    client = redis_server.client()
    value = bytearray(client.get(key) or b"")
    value[-1] ^= 0xFF  # head 3 of block 1
    client.set(key, bytes(value))
    four = engine(redis_server.url, 4)
    assert read(four[:3], hashes) == [d[: 3 * HEAD_BYTES] for d in data]  # heads 0-2 are fine
    with pytest.raises(BlockLoadError, match=r"block .* head 3 not servable"):
        read(four[3:], hashes)
    assert head_store(four[3:]).stats.corrupt_blocks == 1
    assert client.get(key) is None  # deleted: the next lookup stops before it
    assert four[0][0].manager().lookup(hashes) == 1
    assert read(four, hashes[:1]) == data[:1]


def test_a_block_whole_in_any_grouping_is_a_hit(redis_server: RedisServer) -> None:
    """Written by two layouts, each missing a different part: still served whole."""
    hashes, data = blocks(3)
    one, two = engine(redis_server.url, 1), engine(redis_server.url, 2)
    write(one, hashes, data)
    write(two, hashes, data)
    client = redis_server.client()
    client.delete(head_store(one).group_key(hashes[1], HeadGroup(0, HEADS)))
    client.delete(head_store(two).group_key(hashes[2], HeadGroup(0, 2)))
    for layout in (one, two, engine(redis_server.url, 4)):
        assert layout[0][0].manager().lookup(hashes) == 3
        assert read(layout, hashes) == data
    client.delete(head_store(two).group_key(hashes[1], HeadGroup(2, 2)))
    assert one[0][0].manager().lookup(hashes) == 1  # block 1 whole nowhere


def test_replicated_heads_are_written_once_and_read_by_all(redis_server: RedisServer) -> None:
    """Fewer KV heads than workers: four workers, two heads, each head held by two."""
    shards = [HeadShard.of_rank(2, 4, rank) for rank in range(4)]
    assert [(s.first, s.writes) for s in shards] == [(0, True), (0, False), (1, True), (1, False)]
    hashes = [BlockHash(bytes([i]) * 32) for i in range(3)]
    per_head = {h: [bytes([h + 1]) * 64 for _ in hashes] for h in range(2)}
    tiers = [
        RemoteTier.from_url(redis_server.url, SHARED, block_size=16, heads=2, group_heads=1)
        for _ in shards
    ]
    stores = [t.head_store(row_layout(1), s) for t, s in zip(tiers, shards, strict=True)]
    client = redis_server.client()
    for store, shard in zip(stores[1::2], shards[1::2], strict=True):  # the replicas
        rows = [memoryview(v) for v in per_head[shard.first]]
        store.write_blocks(RemoteLoadStoreSpec(hashes), rows)
    assert client.dbsize() == 0  # a replica writes nothing
    for store, shard in zip(stores[::2], shards[::2], strict=True):
        rows = [memoryview(v) for v in per_head[shard.first]]
        store.write_blocks(RemoteLoadStoreSpec(hashes), rows)
    assert client.dbsize() == 2 * len(hashes) + 1  # one copy of each head, the grouping
    for store, shard in zip(stores, shards, strict=True):
        rows = [bytearray(64) for _ in hashes]
        store.read_blocks(RemoteLoadStoreSpec(hashes), [memoryview(r) for r in rows])
        assert [bytes(r) for r in rows] == per_head[shard.first]


def lookup_trips(store: HeadKeyedStore, hashes: list[BlockHash]) -> tuple[int, int]:
    """(blocks found, round trips taken) of one lookup of `hashes`."""
    before = store.lookup_round_trips
    found = store.try_count_prefixes([hashes])
    assert found is not None
    return found[0], store.lookup_round_trips - before


def test_a_walk_that_stops_is_final_where_no_other_grouping_was_written(
    redis_server: RedisServer,
) -> None:
    """One round trip for a lookup that stops (a cold prompt, a partial hit) while only
    this layout ever wrote; a second one, to the other groupings, once another wrote."""
    hashes, data = blocks(4)
    two, one = engine(redis_server.url, 2), engine(redis_server.url, 1)
    assert lookup_trips(head_store(two), hashes) == (0, 1)  # nothing written at all
    write(two, hashes[:2], data[:2])
    assert lookup_trips(head_store(two), hashes) == (2, 1)
    write(one, hashes[2:3], data[2:3])  # another grouping writes a block
    assert lookup_trips(head_store(two), hashes) == (3, 4)  # found there, walked on there
    assert lookup_trips(head_store(two), hashes[3:]) == (0, 2)


def test_a_lost_groupings_set_comes_back_with_the_next_stores(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evicted (or a restarted Redis): the next store names its grouping again, so a
    block of another layout is found again (a grouping named is asked at most every
    REGISTER_EVERY_S per writer)."""
    monkeypatch.setattr("kvtier.remote.head_keys.REGISTER_EVERY_S", 0.0)
    hashes, data = blocks(2)
    two, one = engine(redis_server.url, 2), engine(redis_server.url, 1)
    write(one, hashes[:1], data[:1])
    client = redis_server.client()
    client.delete(head_store(one)._base + b"groupings")
    assert lookup_trips(head_store(two), hashes) == (0, 1)  # not known to be anywhere
    write(one, hashes[1:], data[1:])
    assert lookup_trips(head_store(two), hashes) == (2, 3)


def test_whole_block_calls_cut_and_join_the_heads(redis_server: RedisServer) -> None:
    hashes, data = blocks(3)
    for workers in (1, 2):
        tier = RemoteTier.from_url(
            redis_server.url, SHARED, block_size=16, heads=HEADS, group_heads=HEADS // workers
        )
        assert tier.store.store(hashes[:2], data[:2])
        assert tier.store.try_count_prefixes([hashes]) == [2]  # one question, or several
        assert tier.store.try_count_prefixes([hashes, hashes[:1], hashes[2:]]) == [2, 1, 0]
        assert tier.store.store(hashes[2:], data[2:])
        assert [bytes(v) if v is not None else None for v in tier.store.load(hashes)] == data
        assert read(engine(redis_server.url, 4), hashes) == data
        redis_server.client().flushall()


def test_another_fingerprint_never_reads_the_heads(redis_server: RedisServer) -> None:
    hashes, data = blocks(2)
    write(engine(redis_server.url, 2), hashes, data)
    other = RemoteTier.from_url(redis_server.url, "another model", block_size=16, heads=HEADS)
    assert other.manager().lookup(hashes) == 0
    whole = RemoteTier.from_url(redis_server.url, SHARED, block_size=16)  # one value a block
    assert whole.manager().lookup(hashes) == 0
    eight = engine(redis_server.url, 2, heads=8)  # another head count: another layout
    assert eight[0][0].manager().lookup(hashes) == 0


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
    assert grouping(4, 2) == [HeadGroup(0, 2), HeadGroup(2, 2)]


def test_a_grouping_that_does_not_cut_the_heads_is_refused(redis_server: RedisServer) -> None:
    with pytest.raises(ValueError, match="4 KV heads do not cut into values of 3 heads"):
        RemoteTier.from_url(redis_server.url, SHARED, block_size=16, heads=4, group_heads=3)


class HeadGroupsMachine(RuleBasedStateMachine):
    """Engines of 1, 2 and 4 workers writing, Redis evicting values and bytes going bad,
    against a model: which values are there, and which of their heads are bad."""

    LAYOUTS = (1, 2, 4)
    NUM_BLOCKS = 4

    def __init__(self, server: RedisServer) -> None:
        super().__init__()
        self.client = server.client()
        self.client.flushall()
        self.engines = {n: engine(server.url, n) for n in self.LAYOUTS}
        self.hashes, self.data = blocks(self.NUM_BLOCKS, seed=5)
        # (block, value's group) -> its heads that are corrupt
        self.values: dict[tuple[int, HeadGroup], set[int]] = {}

    def teardown(self) -> None:
        for workers in self.engines.values():
            for tier, _ in workers:
                tier.close()
        self.client.close()

    def key(self, block: int, group: HeadGroup) -> bytes:
        return head_store(self.engines[1]).group_key(self.hashes[block], group)

    def whole(self, block: int) -> bool:
        """Some grouping has every one of its values there (a lookup reads headers)."""
        return any(
            all((block, g) in self.values for g in grouping(HEADS, size)) for size in (1, 2, 4)
        )

    @rule(workers=st.sampled_from(LAYOUTS), first=st.integers(0, 3), count=st.integers(1, 4))
    def write(self, workers: int, first: int, count: int) -> None:
        chosen = list(range(first, min(first + count, self.NUM_BLOCKS)))
        write(
            self.engines[workers],
            [self.hashes[b] for b in chosen],
            [self.data[b] for b in chosen],
        )
        for block in chosen:
            for group in grouping(HEADS, HEADS // workers):
                self.values[(block, group)] = set()

    @rule(block=st.integers(0, 3), size=st.sampled_from((1, 2, 4)), index=st.integers(0, 3))
    def redis_evicts(self, block: int, size: int, index: int) -> None:
        group = grouping(HEADS, size)[index % (HEADS // size)]
        self.client.delete(self.key(block, group))
        self.values.pop((block, group), None)

    @rule(block=st.integers(0, 3), size=st.sampled_from((1, 2, 4)), index=st.integers(0, 3))
    def a_byte_goes_bad(self, block: int, size: int, index: int) -> None:
        """The last byte of a value: its last head."""
        group = grouping(HEADS, size)[index % (HEADS // size)]
        bad = self.values.get((block, group))
        if bad is None:
            return
        key = self.key(block, group)
        value = self.client.get(key) or b""
        self.client.setrange(key, len(value) - 1, bytes([value[-1] ^ 0xFF]))
        bad.symmetric_difference_update({group.end - 1})

    @rule(
        workers=st.sampled_from(LAYOUTS),
        rank=st.integers(0, 3),
        hint=st.sampled_from((0, 1, 2, 4)),
    )
    def load(self, workers: int, rank: int, hint: int) -> None:
        """A worker loads what a lookup offers, told (`hint`, heads a value; 0: not told)
        where to read first, rightly or not: served exactly where the model says."""
        tier, shard = self.engines[workers][rank % workers]
        hit = next((b for b in range(self.NUM_BLOCKS) if not self.whole(b)), self.NUM_BLOCKS)
        if not hit:
            return
        expected = [self.expect(b, shard.group, hint) for b in range(hit)]
        store = tier.head_store(row_layout(shard.count), shard)
        rows = [bytearray(shard.count * HEAD_BYTES) for _ in range(hit)]
        spec = RemoteLoadStoreSpec(self.hashes[:hit], holders=[hint] * hit if hint else None)
        if all(expected):
            store.read_blocks(spec, [memoryview(r) for r in rows])
            span = slice(shard.first * HEAD_BYTES, shard.group.end * HEAD_BYTES)
            assert [bytes(r) for r in rows] == [d[span] for d in self.data[:hit]]
        else:
            with pytest.raises(BlockLoadError, match="not servable"):
                store.read_blocks(spec, [memoryview(r) for r in rows])

    def expect(self, block: int, group: HeadGroup, hint: int = 0) -> bool:
        """Whether a worker holding `group` gets `block`, as `load_group` reads: the
        grouping it was told of, its own value (dropped if bad), then each other
        grouping's values that hold its heads (those whose read heads are bad are
        dropped), fewest values first."""
        order = dict.fromkeys(s for s in (hint, group.count, 4, 2, 1) if s)
        for size in order:
            if size == group.count:
                own = self.values.get((block, group))
                if own is not None and not own:
                    return True
                self.values.pop((block, group), None)
                continue
            first = group.first // size * size
            sources = [HeadGroup(f, size) for f in range(first, group.end, size)]
            served = True
            for source in sources:
                bad = self.values.get((block, source))
                if bad is None:
                    served = False
                elif bad & set(group.heads):
                    del self.values[(block, source)]
                    served = False
            if served:
                return True
        return False

    @invariant()
    def redis_holds_the_values_the_model_does(self) -> None:
        """(A load drops exactly the bad values it read, in the order it reads them.)"""
        held = {
            (block, group)
            for block in range(self.NUM_BLOCKS)
            for size in (1, 2, 4)
            for group in grouping(HEADS, size)
            if self.client.exists(self.key(block, group))
        }
        assert held == set(self.values)

    @invariant()
    def every_layout_finds_what_the_model_holds(self) -> None:
        hit = next((b for b in range(self.NUM_BLOCKS) if not self.whole(b)), self.NUM_BLOCKS)
        for workers in self.engines.values():
            assert workers[0][0].store.try_count_prefix(self.hashes) == hit
        assert head_store(self.engines[1]).stats.errors == 0


def test_head_groups_against_model(redis_server: RedisServer) -> None:
    run_state_machine_as_test(
        lambda: HeadGroupsMachine(redis_server),
        settings=settings(max_examples=60, stateful_step_count=20, deadline=None),
    )
