"""The replay with a real Redis tier below the CPU tier (needs `redis-server`)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvtier.sim.config import ReplayConfig
from kvtier.sim.generator import GeneratorConfig, generate_workload
from kvtier.sim.run import replay

pytestmark = pytest.mark.redis


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    proc = subprocess.Popen([*args, "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):  # wait for the server to accept connections (bounded)
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    client.close()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_remote_tier_serves_what_the_cpu_tier_lost(redis_url: str) -> None:
    workload = generate_workload(GeneratorConfig(num_requests=150), seed=1)
    alone = replay(workload, ReplayConfig("lru", cpu_blocks=40))
    config = ReplayConfig("lru", cpu_blocks=40, redis_url=redis_url)
    both = replay(workload, config)
    cpu, remote = both.tiers
    assert (cpu.name, remote.name) == ("cpu", "remote")
    assert remote.hit_blocks > 0 and remote.bytes_stored > 0 and remote.bytes_loaded > 0
    assert remote.checksum_failures == 0 and remote.stores > 0
    assert both.prefix_hit_blocks > alone.prefix_hit_blocks
    assert both.prefix_hit_blocks == cpu.hit_blocks + remote.hit_blocks


def test_two_engines_share_one_namespace(redis_url: str) -> None:
    workload = generate_workload(GeneratorConfig(num_requests=80), seed=2)
    shared = ReplayConfig("lru", cpu_blocks=20, redis_url=redis_url, redis_namespace="team")
    first = replay(workload, shared)
    second = replay(workload, shared)  # another engine, same trace: the blocks are there
    assert second.tiers[1].hit_blocks > first.tiers[1].hit_blocks
    fresh = replay(workload, ReplayConfig("lru", cpu_blocks=20, redis_url=redis_url))
    assert fresh.tiers[1].hit_blocks == first.tiers[1].hit_blocks  # own namespace: cold


def test_remote_tier_behind_the_accelerator(redis_url: str) -> None:
    workload = generate_workload(GeneratorConfig(num_requests=120), seed=3)
    r = replay(workload, ReplayConfig("lru", gpu_blocks=300, cpu_blocks=30, redis_url=redis_url))
    assert [t.name for t in r.tiers] == ["gpu", "cpu", "remote"]
    assert sum(t.hit_blocks for t in r.tiers) == r.prefix_hit_blocks
    assert r.tiers[2].hit_blocks > 0


def test_cpu_disk_and_remote(redis_url: str) -> None:
    workload = generate_workload(GeneratorConfig(num_requests=150), seed=4)
    config = ReplayConfig("lru", cpu_blocks=30, disk_blocks=200, redis_url=redis_url)
    r = replay(workload, config)
    assert [t.name for t in r.tiers] == ["cpu", "disk", "remote"]
    assert sum(t.hit_blocks for t in r.tiers) == r.prefix_hit_blocks
    assert r.tiers[1].hit_blocks > 0 and r.tiers[2].hit_blocks > 0


def test_real_bytes_through_redis_are_verified(redis_url: str) -> None:
    pytest.importorskip("torch")
    from kvtier.sim.bytes_plane import small_layout

    workload = generate_workload(GeneratorConfig(num_requests=60), seed=6)
    plain = replay(workload, ReplayConfig("lru", cpu_blocks=20, redis_url=redis_url))
    moved = replay(workload, ReplayConfig("lru", cpu_blocks=20, redis_url=redis_url, data=True))
    cpu, remote = moved.tiers
    # Real bytes: no promotion from Redis into CPU slots, so the split may differ, but
    # whatever was served was verified byte for byte.
    assert moved.prefix_hit_blocks >= plain.tiers[0].hit_blocks
    size = small_layout(workload.block_size).bytes_per_block
    assert remote.hit_blocks > 0 and remote.bytes_loaded == remote.hit_blocks * size
    assert cpu.bytes_loaded == cpu.hit_blocks * size
    assert cpu.checksum_failures == remote.checksum_failures == 0


def test_an_unreachable_redis_stores_nothing() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workload = generate_workload(GeneratorConfig(num_requests=40), seed=7)
    config = ReplayConfig("lru", cpu_blocks=400, redis_url=f"redis://127.0.0.1:{port}/0")
    cpu, remote = replay(workload, config).tiers
    assert cpu.stores > 0 and remote.stores == remote.hit_blocks == 0  # planned, never written
    assert remote.errors > 0 and cpu.errors == 0  # and the failed calls are counted
