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

from kvtier.sim.generator import GeneratorConfig, generate_workload
from kvtier.sim.replay_config import ReplayConfig
from kvtier.sim.run import replay

pytestmark = pytest.mark.redis


class Server:
    """A throwaway redis-server on a free port (killed with `kill()`)."""

    def __init__(self, directory: Path, *options: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server not installed")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
        args += ["no", "--dir", str(directory), *options]
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            args, stdout=subprocess.DEVNULL
        )
        self.url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(self.url)
        for _ in range(200):  # wait for the server to accept connections (bounded)
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    yield s
    s.kill()


@pytest.fixture
def redis_url(server: Server) -> str:
    return server.url


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


FAULTS = generate_workload(GeneratorConfig(num_requests=60), seed=8)


@pytest.mark.parametrize("data", [False, True], ids=["bookkeeping", "data"])
@pytest.mark.parametrize("fault", ["killed", "full"])
def test_a_failing_redis_never_raises_the_hit_rates(tmp_path: Path, fault: str, data: bool) -> None:
    if data:
        pytest.importorskip("torch")
    options = ("--maxmemory", "1", "--maxmemory-policy", "noeviction") if fault == "full" else ()
    server = Server(tmp_path, *options)
    try:
        alone = replay(FAULTS, ReplayConfig("lru", cpu_blocks=30, data=data))
        config = ReplayConfig("lru", cpu_blocks=30, data=data, redis_url=server.url)

        def kill_at_start(done: int) -> None:
            if fault == "killed":
                server.kill()

        broken = replay(FAULTS, config, kill_at_start)
    finally:
        server.kill()
    assert broken.hit_rate <= alone.hit_rate
    assert broken.prefix_hit_rate <= alone.prefix_hit_rate
    remote = broken.tiers[-1]
    assert remote.name == "remote" and remote.hit_blocks == remote.stores == 0
    assert remote.errors > 0  # every failed call or transfer is counted
    if fault == "full":  # what a full server refused is a refused store
        assert remote.store_rejections > 0


def test_fault_free_figures_equal_with_and_without_bytes_through_redis(redis_url: str) -> None:
    pytest.importorskip("torch")
    from dataclasses import replace

    from tests.sim.test_faults import figures

    workload = generate_workload(GeneratorConfig(num_requests=50), seed=9)
    for extra in ({}, {"gpu_blocks": 200}, {"disk_blocks": 300}):
        config = ReplayConfig("lru", cpu_blocks=20, redis_url=redis_url, **extra)  # type: ignore[arg-type]
        plain, moved = replay(workload, config), replay(workload, replace(config, data=True))
        assert figures(plain) == figures(moved)
        assert all(t.checksum_failures == t.errors == 0 for t in moved.tiers)
        assert moved.tiers[-1].hit_blocks > 0
