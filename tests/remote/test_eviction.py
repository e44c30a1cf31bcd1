"""Eviction is Redis's own: maxmemory with allkeys-lru; lookups stop at the holes it leaves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.remote.breaker import BreakerState
from kvtier.remote.redis_store import RedisBlockStore
from kvtier.remote.remote_config import RemoteConfig
from kvtier.types import int_block_hash
from tests.remote.conftest import FakeClock, RedisServer, serve_redis

FP = "model=tiny|dtype=fp16|block=16|format=1"
# Generous timeouts: these tests are about eviction, not about a slow server.
TIMEOUTS = {"socket_timeout_s": 5.0, "connect_timeout_s": 5.0}
BLOCK = 64 * 1024
HASHES = [int_block_hash(i) for i in range(160)]  # 10 MiB of blocks into 4 MiB


@pytest.fixture
def small_lru_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from serve_redis(
        tmp_path, None, "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"
    )


@pytest.fixture
def small_noeviction_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from serve_redis(tmp_path, None, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction")


def test_lru_server_evicts_and_lookups_stop_at_the_first_hole(
    small_lru_server: RedisServer,
) -> None:
    config = RemoteConfig(url=small_lru_server.url, **TIMEOUTS)  # type: ignore[arg-type]
    store = RedisBlockStore.connect(config, FP, FakeClock())
    for start in range(0, len(HASHES), 8):
        batch = HASHES[start : start + 8]
        assert store.store(batch, [bytes([start % 251]) * BLOCK] * len(batch))
    client = small_lru_server.client()
    # Redis evicts on ANY command while over maxmemory, reads included; lift the limit
    # so the snapshot below and the lookups see the same holes.
    client.config_set("maxmemory", 0)
    present = [bool(client.exists(store.key(h))) for h in HASHES]
    assert 0 < sum(present) < len(HASHES)  # Redis evicted some, kept some
    assert present[-1]  # the most recent survived
    for start in (0, 40, 80, 120, 150):  # every chain answers up to its first hole
        chain = HASHES[start:]
        expected = next((i for i, ok in enumerate(present[start:]) if not ok), len(chain))
        assert store.count_prefix(chain) == expected
    assert store.stats.errors == 0
    client.close()


def test_full_noeviction_server_fails_stores_but_keeps_serving(
    small_noeviction_server: RedisServer,
) -> None:
    config = RemoteConfig(url=small_noeviction_server.url, **TIMEOUTS)  # type: ignore[arg-type]
    store = RedisBlockStore.connect(config, FP, FakeClock())
    results = [
        store.store(HASHES[i : i + 8], [b"\1" * BLOCK] * 8) for i in range(0, len(HASHES), 8)
    ]
    assert results[0] and not results[-1]  # OOM answers are failed stores, never exceptions
    num_stored = 8 * results.index(False)
    assert store.stats.errors == results.count(False)
    # a full server is not a dead one: the breaker stays closed and lookups still hit
    assert store.breaker.state is BreakerState.CLOSED
    assert store.count_prefix(HASHES) >= num_stored > 0
