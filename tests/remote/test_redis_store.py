"""The Redis store against a real redis-server: round trips, holes, refusals, tenancy."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.remote.breaker import BreakerConfig, BreakerState
from kvtier.remote.codec import BlockCodec
from kvtier.remote.redis_store import RedisBlockStore, RemoteStartupError
from kvtier.remote.remote_config import RemoteConfig
from kvtier.types import int_block_hash
from tests.remote.conftest import FakeClock, RedisServer, require_redis

FP = "model=tiny|dtype=fp16|layout=contiguous|block=16|hash=sha256_cbor|format=1"
HASHES = [int_block_hash(i) for i in range(8)]
PAYLOADS = [bytes([i]) * (1000 + i) for i in range(8)]


def connect(server: RedisServer, fingerprint: str = FP, **kwargs: object) -> RedisBlockStore:
    kwargs.setdefault("socket_timeout_s", 5.0)  # not a timeout test: a loaded CI box is slow
    config = RemoteConfig(url=server.url, **kwargs)  # type: ignore[arg-type]
    return RedisBlockStore.connect(config, fingerprint, FakeClock())


def test_store_then_load_round_trip(redis_server: RedisServer) -> None:
    store = connect(redis_server)
    assert store.store(HASHES, PAYLOADS)
    assert store.count_prefix(HASHES) == 8
    assert [bytes(v) for v in store.load(HASHES) if v is not None] == PAYLOADS
    stats = store.stats
    assert (stats.stored_blocks, stats.loaded_blocks, stats.lookup_hit_blocks) == (8, 8, 8)
    assert stats.stored_bytes == stats.loaded_bytes == sum(map(len, PAYLOADS))


def test_blocks_given_in_pieces_are_stored_as_the_pieces_end_to_end(
    redis_server: RedisServer,
) -> None:
    """A CPU slot's segments, sent as they lie (many to a `sendmsg`, which a 16 MiB
    store fills the socket with, so that sends end part-way through a piece)."""
    store = connect(redis_server)
    pieces = [[bytes([i, k]) * 8192 for k in range(16)] for i in range(64)]
    hashes = [int_block_hash(100 + i) for i in range(64)]
    assert store.store_pieces(hashes, pieces)
    loaded = store.load(hashes)
    assert [bytes(v) for v in loaded if v is not None] == [b"".join(p) for p in pieces]
    assert store.stats.stored_bytes == 64 * 16 * 16384
    with pytest.raises(ValueError, match="2 hashes but 1 payloads"):
        store.store_pieces(hashes[:2], pieces[:1])


def test_several_lookups_in_one_round_trip_answer_as_each_alone(
    redis_server: RedisServer,
) -> None:
    store = connect(redis_server)
    store.store(HASHES[:5], PAYLOADS[:5])
    redis_server.client().delete(store.key(HASHES[3]))
    questions = [HASHES[:1], HASHES[1:], [HASHES[6]], [], HASHES[4:5]]
    assert store.try_count_prefixes(questions) == [1, 2, 0, 0, 1]
    assert [store.count_prefix(q) for q in questions] == [1, 2, 0, 0, 1]
    assert (store.stats.lookups, store.stats.lookup_hit_blocks) == (9, 8)  # (no call for [])
    redis_server.kill()
    assert store.try_count_prefixes(questions) is None  # no answer: not 0 each
    assert store.count_prefix(HASHES) == 0
    store.close()


def test_lookup_stops_at_the_first_hole(redis_server: RedisServer) -> None:
    store = connect(redis_server)
    store.store(HASHES, PAYLOADS)
    redis_server.client().delete(store.key(HASHES[3]))  # as if Redis evicted it
    assert store.count_prefix(HASHES) == 3
    assert store.count_prefix(HASHES[4:]) == 4
    loaded = store.load(HASHES[2:5])
    assert loaded[1] is None and store.stats.missing_blocks == 1


def test_corrupt_value_is_counted_dropped_and_a_miss(redis_server: RedisServer) -> None:
    store = connect(redis_server)
    store.store(HASHES, PAYLOADS)
    client = redis_server.client()
    client.setrange(store.key(HASHES[1]), 48 + 500, b"\xff")  # one flipped payload byte
    assert store.count_prefix(HASHES) == 8  # the header is intact: only a load can tell
    loaded = store.load(HASHES[:3])
    assert loaded[1] is None and loaded[0] is not None and loaded[2] is not None
    assert store.stats.corrupt_blocks == 1
    assert client.exists(store.key(HASHES[1])) == 0  # dropped: the next lookup stops there
    assert store.count_prefix(HASHES) == 1


def test_value_of_another_fingerprint_is_ignored(redis_server: RedisServer) -> None:
    store = connect(redis_server)
    foreign = BlockCodec.for_fingerprint("model=other|dtype=fp8")
    redis_server.client().set(store.key(HASHES[0]), foreign.encode(HASHES[0], b"x" * 64))
    assert store.count_prefix(HASHES) == 0
    assert store.load(HASHES[:1]) == [None]
    assert store.stats.foreign_blocks == 2


def test_garbage_and_misplaced_values_are_refused(redis_server: RedisServer) -> None:
    store = connect(redis_server)
    store.store(HASHES[:2], PAYLOADS[:2])
    client = redis_server.client()
    client.set(store.key(HASHES[2]), b"\x80\x04\x95 a pickle would be here")
    client.copy(store.key(HASHES[0]), store.key(HASHES[3]))  # valid value, wrong key
    assert store.count_prefix(HASHES) == 2
    assert store.count_prefix(HASHES[3:]) == 0
    stats = store.stats
    assert (stats.malformed_blocks, stats.wrong_key_blocks) == (1, 1)


def test_engines_of_different_layouts_never_share(redis_server: RedisServer) -> None:
    ours, theirs = connect(redis_server), connect(redis_server, fingerprint=FP + "-fp8")
    ours.store(HASHES, PAYLOADS)
    assert theirs.count_prefix(HASHES) == 0
    assert connect(redis_server).count_prefix(HASHES) == 8  # same layout: shared


def test_tenants_with_different_salts_never_share(redis_server: RedisServer) -> None:
    store = connect(redis_server)
    store.store(HASHES, PAYLOADS, salt="tenant-a")
    assert store.count_prefix(HASHES, salt="tenant-a") == 8
    assert store.count_prefix(HASHES, salt="tenant-b") == 0
    assert store.count_prefix(HASHES) == 0
    assert store.key(HASHES[0], "a") != store.key(HASHES[0], "b") != store.key(HASHES[0])


def test_keys_carry_the_block_as_cluster_hash_tag() -> None:
    config = RemoteConfig()
    store = RedisBlockStore(None, BlockCodec.for_fingerprint(FP), config)  # type: ignore[arg-type]
    key = store.key(int_block_hash(255), salt="t")
    assert key.startswith(b"kvt:") and key.endswith(b"{00000000000000ff}")


def test_ttl_is_applied(redis_server: RedisServer) -> None:
    store = connect(redis_server, ttl_s=100)
    store.store(HASHES[:1], PAYLOADS[:1])
    assert 0 < redis_server.client().ttl(store.key(HASHES[0])) <= 100


def test_mismatched_payload_count_is_an_error_before_any_io(redis_server: RedisServer) -> None:
    store = connect(redis_server)
    with pytest.raises(ValueError, match="2 hashes but 1 payloads"):
        store.store(HASHES[:2], PAYLOADS[:1])
    assert store.count_prefix(HASHES) == 0


def test_password_server(redis_server_with_password: RedisServer) -> None:
    server = redis_server_with_password
    store = connect(server)
    assert store.store(HASHES[:1], PAYLOADS[:1])
    wrong = RemoteConfig(url=f"redis://:nope@127.0.0.1:{server.port}/0")
    with pytest.raises(RemoteStartupError, match=r"refused our credentials.*password") as info:
        RedisBlockStore.connect(wrong, FP)
    assert "nope" not in str(info.value)  # never echo the secret
    missing = RemoteConfig(url=f"redis://127.0.0.1:{server.port}/0")
    with pytest.raises(RemoteStartupError, match="refused our credentials"):
        RedisBlockStore.connect(missing, FP)
    override = RemoteConfig(url=f"redis://:nope@127.0.0.1:{server.port}/0", password="s3cret-pw")
    assert RedisBlockStore.connect(override, FP).count_prefix(HASHES) == 1


def test_lookup_without_server_scripting_falls_back_to_pipelines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    require_redis()
    server = RedisServer(
        tmp_path, None, "--rename-command", "EVALSHA", "", "--rename-command", "EVAL", ""
    )
    server.start()
    try:
        store = connect(server)
        store.store(HASHES, PAYLOADS)
        client = server.client()
        client.delete(store.key(HASHES[5]))
        assert store.count_prefix(HASHES) == 5  # the script is refused, the pipeline answers
        assert store.count_prefix(HASHES) == 5 and store.stats.errors == 0
        assert [r.message for r in caplog.records if "script refused" in r.message] != []
        client.close()
    finally:
        server.kill()


def test_single_block_and_scripted_lookups_agree_on_refusals(redis_server: RedisServer) -> None:
    store = connect(redis_server)
    foreign = BlockCodec.for_fingerprint("model=other")
    redis_server.client().set(store.key(HASHES[0]), foreign.encode(HASHES[0], b"x"))
    assert store.count_prefix(HASHES[:1]) == 0  # one key: pipelined
    assert store.count_prefix(HASHES) == 0  # several: scripted
    assert store.stats.foreign_blocks == 2


def test_a_key_of_another_type_is_refused_not_an_error(redis_server: RedisServer) -> None:
    store = connect(redis_server)
    store.store(HASHES, PAYLOADS)
    client = redis_server.client()
    client.delete(store.key(HASHES[4]))
    client.rpush(store.key(HASHES[4]), b"someone else's list")
    assert store.count_prefix(HASHES) == 4  # scripted
    assert store.count_prefix(HASHES[4:5]) == 0  # pipelined
    assert store.load(HASHES[4:5]) == [None]
    stats = store.stats
    assert (stats.malformed_blocks, stats.errors) == (2, 0)
    client.close()


class _FailingPing:
    """A client whose PING fails with each of `errors` in turn."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)

    def ping(self) -> bool:
        raise self.errors.pop(0)


def test_a_probe_that_raises_a_bug_does_not_wedge_the_breaker() -> None:
    clock = FakeClock()
    config = RemoteConfig(breaker=BreakerConfig(failure_threshold=1, reset_timeout_s=5.0))
    client = _FailingPing(ConnectionError("down"), TypeError("a bug"))
    store = RedisBlockStore(client, BlockCodec.for_fingerprint(FP), config, clock)  # type: ignore[arg-type]
    assert not store.ping()  # opens the breaker
    clock.advance(5.0)
    with pytest.raises(TypeError, match="a bug"):
        store.ping()  # the half-open probe: raises, and counts as a failure
    assert store.breaker.state is BreakerState.OPEN
    clock.advance(5.0)
    assert store.breaker.allow()  # a new probe after a full period
    assert store.stats.errors == 2
