"""Faults against a real server: killed, hung, restarted. Nothing ever raises."""

from __future__ import annotations

from kvtier.remote.breaker import BreakerConfig, BreakerState
from kvtier.remote.redis_store import RedisBlockStore
from kvtier.remote.remote_config import RemoteConfig
from kvtier.types import int_block_hash
from tests.remote.conftest import FakeClock, RedisServer

FP = "model=tiny|dtype=fp16|block=16|format=1"
HASHES = [int_block_hash(i) for i in range(6)]
PAYLOADS = [bytes([i]) * 4096 for i in range(6)]


def connect(server: RedisServer, clock: FakeClock, timeout_s: float = 0.25) -> RedisBlockStore:
    config = RemoteConfig(
        url=server.url,
        socket_timeout_s=timeout_s,
        connect_timeout_s=timeout_s,
        breaker=BreakerConfig(failure_threshold=3, reset_timeout_s=10.0),
    )
    return RedisBlockStore.connect(config, FP, clock)


def test_killed_server_opens_the_breaker_and_a_restart_closes_it(
    redis_server: RedisServer,
) -> None:
    clock = FakeClock()
    store = connect(redis_server, clock)
    assert store.store(HASHES, PAYLOADS) and store.count_prefix(HASHES) == 6
    redis_server.kill()
    # every kind of call fails soft: a miss, an empty load, a failed store
    assert store.count_prefix(HASHES) == 0
    assert store.load(HASHES[:2]) == [None, None]
    assert not store.store(HASHES[:1], PAYLOADS[:1])
    assert store.breaker.state is BreakerState.OPEN
    errors = store.stats.errors
    assert errors == 3 and store.stats.breaker_opened == 1
    # open: no call reaches the network, each is a counted skip
    assert store.count_prefix(HASHES) == 0 and not store.ping()
    assert store.stats.errors == errors and store.stats.skipped_calls == 2
    redis_server.start()  # same port, empty (no persistence)
    assert store.count_prefix(HASHES) == 0  # still open until the period ends
    clock.advance(10.0)
    assert store.store(HASHES, PAYLOADS)  # the probe reconnects and succeeds
    assert store.breaker.state is BreakerState.CLOSED
    assert store.count_prefix(HASHES) == 6
    assert [bytes(v) for v in store.load(HASHES) if v is not None] == PAYLOADS
    store.close()


def test_probe_against_a_still_dead_server_reopens(redis_server: RedisServer) -> None:
    clock = FakeClock()
    store = connect(redis_server, clock)
    redis_server.kill()
    for _ in range(3):
        store.count_prefix(HASHES)
    clock.advance(10.0)
    assert store.count_prefix(HASHES) == 0  # the probe fails
    assert store.breaker.state is BreakerState.OPEN and store.stats.breaker_opened == 2
    store.close()


def test_hung_server_costs_one_timeout_per_call_until_the_breaker_opens(
    redis_server: RedisServer,
) -> None:
    clock = FakeClock()
    store = connect(redis_server, clock, timeout_s=0.1)
    store.store(HASHES, PAYLOADS)
    redis_server.pause()  # accepts nothing, answers nothing: only timeouts can tell
    try:
        for _ in range(3):
            assert store.count_prefix(HASHES) == 0
        assert store.breaker.state is BreakerState.OPEN
        assert store.load(HASHES) == [None] * 6  # refused at once, no timeout paid
    finally:
        redis_server.resume()
    clock.advance(10.0)
    assert store.count_prefix(HASHES) == 6  # back, with its data
    store.close()


def test_unreachable_at_start_up_is_not_fatal(redis_server: RedisServer) -> None:
    redis_server.kill()
    clock = FakeClock()
    store = connect(redis_server, clock)  # engines start while Redis restarts
    assert store.stats.errors == 1
    assert store.count_prefix(HASHES) == 0
    redis_server.start()
    assert store.store(HASHES, PAYLOADS)  # two failures were below the threshold
    assert store.count_prefix(HASHES) == 6
    store.close()
