"""Lookups that carry blocks (`kvtier.remote.prefetch`), in a real Redis: a one-worker
engine's lookup reads its first blocks whole and the load that follows takes them without
a round trip; nobody else's lookups read a byte they would not use; nothing carried is
trusted; and the kept values stay within their bounds (a model-based test)."""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.remote import redis_store
from kvtier.remote.head_codec import HeadGroup
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
def carried(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> PrefetchedValues:
    """This test's own values, in its own directory (stores built after it use them)."""
    values = PrefetchedValues(root=tmp_path)
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


def value_keys(tier: RemoteTier, hashes: list[BlockHash]) -> list[bytes]:
    """The keys of the blocks' values (one a block: one worker's, all heads)."""
    return head_store(tier).group_store(HeadGroup(0, HEADS))._keys(hashes, None)


def ask(tier: RemoteTier, hashes: list[BlockHash], fetch: int) -> list[int] | None:
    """As the asynchronous lookups ask: a question a block, in one round trip."""
    return head_store(tier).try_count_prefixes([[h] for h in hashes], None, fetch)


def load(worker: HeadShardKVStore, hashes: list[BlockHash], carried: int) -> list[bytes]:
    """As the worker loads: `carried` blocks of them the scheduler said its lookup read."""
    rows = [bytearray(HEADS * HEAD_BYTES) for _ in hashes]
    spec = RemoteLoadStoreSpec(hashes)
    spec.prefetched = carried
    worker.read_blocks(spec, [memoryview(r) for r in rows])
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
    assert load(worker, hashes, carried=2) == data
    assert calls(client) == {"mget": 1}  # the third block only
    assert head_store(tier).stats.prefetch_loaded_blocks == 2
    assert carried.count(value_keys(tier, hashes)) == 0  # taken: one load each
    assert ask(tier, hashes, fetch=3) == [1, 1, 1]
    client.config_resetstat()
    assert load(worker, hashes, carried=3) == data
    assert calls(client) == {}  # every block carried: no round trip at all


def test_a_block_evicted_after_its_lookup_carried_it_still_loads(
    redis_server: RedisServer, carried: PrefetchedValues
) -> None:
    tier, worker, hashes, data = written(redis_server.url, 2)
    assert ask(tier, hashes, fetch=2) == [1, 1]
    redis_server.client().flushall()
    assert load(worker, hashes, carried=2) == data


def test_a_lookup_carries_nothing_where_no_worker_here_loads_whole_blocks(
    redis_server: RedisServer, carried: PrefetchedValues
) -> None:
    """The replay tool (no worker at all) and an engine some of whose workers do not
    take what a lookup carries (here a tensor-parallel engine's second worker, which
    never started) read headers only."""
    tier, worker, hashes, data = written(redis_server.url, 2)
    del worker
    with warnings.catch_warnings():  # other tests' unclosed sockets are not this one's
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()  # the worker's registration goes with it
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


def test_a_carried_value_is_verified_at_load_like_any_other(
    redis_server: RedisServer, carried: PrefetchedValues
) -> None:
    tier, worker, hashes, _ = written(redis_server.url, 1)
    assert ask(tier, hashes, fetch=1) == [1]
    (path,) = carried.directory().glob("v*")
    value = path.read_bytes()
    path.write_bytes(value[:-1] + bytes([value[-1] ^ 0xFF]))  # one bit flipped
    with pytest.raises(BlockLoadError):
        load(worker, hashes, carried=1)
    assert head_store(tier).stats.corrupt_blocks == 1
    (key,) = value_keys(tier, hashes)
    assert redis_server.client().exists(key) == 0  # dropped, as a corrupt value read there


def test_asynchronous_lookups_carry_what_the_connector_asks_and_a_load_says_so(
    redis_server: RedisServer, carried: PrefetchedValues
) -> None:
    tier, _worker, hashes, _ = written(redis_server.url, 4)
    manager = tier.manager(async_lookup=True)
    manager.fetch_with(lambda: 3)
    try:
        with manager.held_lookups():
            for h in hashes:
                assert manager.lookup([h]) is None
        assert manager.wait_lookups(5.0)
        assert [manager.lookup([h]) for h in hashes] == [1, 1, 1, 1]
        assert manager.take_lookup_seconds() == []  # a round trip that carried: no sample
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
    """The kept values against a model: what the scheduler wrote (its index, oldest
    first, whose bytes count against the budget until dropped past the age or the
    budget, even once taken) and the files a worker can still take."""

    MAX_BYTES, MAX_AGE = 10, 5.0

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.root = Path(tempfile.mkdtemp())
        self.values = PrefetchedValues(self.root, self.MAX_BYTES, self.MAX_AGE, lambda: self.now)
        self.index: dict[bytes, tuple[int, float]] = {}
        self.files: dict[bytes, bytes] = {}

    def teardown(self) -> None:
        self.values.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def _drop(self, key: bytes) -> None:
        del self.index[key]
        self.files.pop(key, None)

    def _expire(self) -> None:
        for key, (_, at) in list(self.index.items()):
            if self.now - at > self.MAX_AGE:
                self._drop(key)

    @rule(key=st.sampled_from(KEYS), size=st.integers(0, 12), fill=st.binary(min_size=1))
    def put(self, key: bytes, size: int, fill: bytes) -> None:
        value = (fill * size)[:size]
        kept = self.values.put(key, value)
        assert kept == (size <= self.MAX_BYTES)
        if not kept:
            return
        self._expire()
        self.index.pop(key, None)
        while self.index and sum(n for n, _ in self.index.values()) + size > self.MAX_BYTES:
            self._drop(next(iter(self.index)))
        self.index[key] = (size, self.now)
        self.files[key] = value

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def take(self, keys: list[bytes]) -> None:
        want = [self.files.pop(key, None) for key in keys]
        assert self.values.take(keys) == want

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def count(self, keys: list[bytes]) -> None:
        if self.index:
            self._expire()
        assert self.values.count(keys) == sum(k in self.index and k in self.files for k in keys)

    @rule(seconds=st.sampled_from([0.5, 2.0, 5.0, 6.0]))
    def wait(self, seconds: float) -> None:
        self.now += seconds

    @rule()
    def clear(self) -> None:
        self.values.clear()
        self.index.clear()
        self.files.clear()

    @invariant()
    def within_budget(self) -> None:
        assert self.values.held_bytes == sum(n for n, _ in self.index.values())
        assert self.values.held_bytes <= self.MAX_BYTES
        names = {p.name for p in self.values.directory().glob("v*")}
        assert len(names) == len(self.files)  # nothing left behind, nothing half-written


PrefetchedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30)
test_prefetched_values_against_model = PrefetchedMachine.TestCase


def test_a_worker_process_takes_what_its_parent_scheduler_kept(tmp_path: Path) -> None:
    """vLLM runs the workers of most engines as child processes of the scheduler's: a
    child says it serves a key base in its parent's directory and takes the values the
    parent kept there (once each); the parent sees it serve while it lives."""
    values = PrefetchedValues(root=tmp_path)
    assert values.put(b"k:1", b"one") and values.put(b"k:2", b"two")
    child = f"""
import sys
from pathlib import Path
from kvtier.remote.prefetch import PrefetchedValues
values = PrefetchedValues(root=Path({str(tmp_path)!r}))
values.serve(b"k:")
print("serving", flush=True)
sys.stdin.readline()
print(values.take([b"k:1", b"k:2", b"k:1", b"k:3"]), flush=True)
values.unserve(b"k:")
"""
    with subprocess.Popen(
        [sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            assert proc.stdout.readline().strip() == "serving"
            assert values.serves(b"k:") and not values.serves(b"other:")
            assert values.count([b"k:1", b"k:2"]) == 2
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "[b'one', b'two', None, None]"
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
    assert not values.serves(b"k:")
    assert values.count([b"k:1", b"k:2"]) == 0
