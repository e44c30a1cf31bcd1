"""`kvtier replay --engines N`: N replay stacks behind the router's routing code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.router.replay import replay_engines
from kvtier.sim import GeneratorConfig, ReplayConfig, TimeModel, generate_workload, replay
from kvtier.sim.traces import TraceRequest
from kvtier.sim.workload import Workload
from tests.sim.test_remote_replay import Server


@pytest.fixture(scope="module")
def chats() -> Workload:
    return generate_workload(GeneratorConfig(num_requests=600, mix=(1.0, 0.0, 0.0)), seed=3)


@pytest.mark.parametrize("gpu_blocks", [0, 200])
def test_one_engine_is_the_single_engine_replay(chats: Workload, gpu_blocks: int) -> None:
    config = ReplayConfig(cpu_blocks=300, gpu_blocks=gpu_blocks)
    one = replay_engines(chats, config, 1)
    alone = replay(chats, config, general=True)
    assert one.prefix_hit_blocks == alone.prefix_hit_blocks
    assert one.prefill_tokens_saved == alone.prefill_tokens_saved
    assert one.unschedulable == alone.extra.get("unschedulable_requests", 0)
    assert set(one.assignment) - {""} == {"e0"}  # "": too large for the pool


@pytest.mark.parametrize("gpu_blocks", [0, 200])
def test_kv_routing_beats_round_robin_and_stays_under_the_bound(
    chats: Workload, gpu_blocks: int
) -> None:
    config = ReplayConfig(cpu_blocks=150, gpu_blocks=gpu_blocks)
    kv = replay_engines(chats, config, 4, "kv")
    rr = replay_engines(chats, config, 4, "round-robin")
    assert kv.prefix_hit_blocks > 1.2 * rr.prefix_hit_blocks
    assert kv.prefix_hit_rate <= kv.bounds.infinite_prefix
    assert kv.bounds.capacity == 4 * (150 + gpu_blocks)
    assert rr.assignment[:8] == ("e0", "e1", "e2", "e3") * 2
    for result in (kv, rr):
        routed = sum(e.requests for e in result.engines)
        assert routed + result.unschedulable == len(chats.requests)


def _same_prompt(gap_ms: float) -> Workload:
    requests = tuple(TraceRequest(k * gap_ms, 64, 400, (1, 2, 3, 4)) for k in range(40))
    return Workload("same-prompt", requests, 16, True)


def test_a_hot_prefix_spreads_when_its_engine_is_busy() -> None:
    config = ReplayConfig(cpu_blocks=10)
    # one after the other (an hour apart): all but the first find it on e0
    apart = replay_engines(_same_prompt(3_600_000.0), config, 4, "kv")
    assert set(apart.assignment) == {"e0"}
    # all at once: each decode keeps its engine busy (400 tokens at 40/s); at ten
    # requests in flight (load 0.1 each) a cached prompt no longer beats an idle engine
    together = replay_engines(_same_prompt(0.0), config, 4, "kv")
    assert [e.requests for e in together.engines] == [10, 10, 10, 10]


@pytest.mark.parametrize("gpu_blocks", [0, 100])
def test_an_engine_of_two_workers_has_twice_their_tiers(chats: Workload, gpu_blocks: int) -> None:
    """Each worker brings its pool and its per-worker budgets (holding half of each block)."""
    config = ReplayConfig(cpu_blocks=150, gpu_blocks=gpu_blocks)
    two = replay_engines(chats, config, 1, sizes=[2])
    alone = replay(chats, ReplayConfig(cpu_blocks=300, gpu_blocks=2 * gpu_blocks), general=True)
    assert two.prefix_hit_blocks == alone.prefix_hit_blocks
    assert two.engines[0].workers == 2
    assert two.bounds.capacity == 2 * (150 + gpu_blocks)
    mixed = replay_engines(chats, ReplayConfig(cpu_frac=0.05), 3, sizes=[1, 2, 4])
    assert [e.workers for e in mixed.engines] == [1, 2, 4]
    assert mixed.bounds.capacity == 7 * ReplayConfig(cpu_frac=0.05).cpu_capacity(chats)


def test_what_a_multi_engine_replay_refuses(chats: Workload) -> None:
    with pytest.raises(ValueError, match="engines must be >= 1"):
        replay_engines(chats, ReplayConfig(cpu_blocks=10), 0)
    with pytest.raises(ValueError, match="--concurrent"):
        replay_engines(chats, ReplayConfig(cpu_blocks=10, time_model=TimeModel()), 2)
    with pytest.raises(ValueError, match="unknown routing policy"):
        replay_engines(chats, ReplayConfig(cpu_blocks=10), 2, "random")
    with pytest.raises(ValueError, match=r"sizes must be 2 worker counts >= 1, got \[1, 0\]"):
        replay_engines(chats, ReplayConfig(cpu_blocks=10), 2, sizes=[1, 0])
    with pytest.raises(ValueError, match="sizes must be 2 worker counts"):
        replay_engines(chats, ReplayConfig(cpu_blocks=10), 2, sizes=[1])


def test_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--limit", "200", "--cpu-blocks", "50", "--policy", "lru,arc"]
    assert main([*argv, "--engines", "3", "--router", "round-robin", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["engines"], doc["router"]) == (3, "round-robin")
    assert [r["policy"] for r in doc["results"]] == ["lru", "arc"]
    for r in doc["results"]:
        assert [e["engine"] for e in r["engines"]] == ["e0", "e1", "e2"]
        assert r["total"]["requests"] == 200
        assert 0 <= r["total"]["prefix_hit_rate"] <= r["bounds"]["infinite_prefix"]
    assert main([*argv, "--engines", "2"]) == 0
    table = capsys.readouterr().out
    assert "2 engines, router kv" in table and "Belady" in table
    assert main([*argv, "--router", "kv"]) == 2
    assert "--router applies only with several engines" in capsys.readouterr().err
    assert main([*argv, "--engines", "2", "--engine-sizes", "1,2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["engine_sizes"] == [1, 2]
    assert [e["workers"] for e in doc["results"][0]["engines"]] == [1, 2]
    assert main([*argv, "--engines", "3", "--engine-sizes", "1,2"]) == 2
    assert "--engine-sizes gives 2 engine(s) (1,2) but --engines is 3" in capsys.readouterr().err
    assert main([*argv, "--engine-sizes", "2"]) == 2
    assert "--engine-sizes applies only with several engines" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--engines", "2", "--engine-sizes", "1,0"])
    assert "worker counts >= 1" in capsys.readouterr().err


@pytest.mark.redis
def test_a_shared_redis_serves_every_engine(chats: Workload, tmp_path: Path) -> None:
    """Round-robin over engines with tiny CPU tiers and one Redis: a returning prompt
    on another engine is served from Redis, which the KV-aware router also counts."""
    server = Server(tmp_path)
    try:
        config = ReplayConfig(cpu_blocks=20, redis_url=server.url)
        rr = replay_engines(chats.limited(200), config, 2, "round-robin")
        assert sum(e.tier_hits["remote"] for e in rr.engines) > 0
        assert all(e.tier_hits["remote"] > 0 for e in rr.engines)  # both read the other's
        # an engine of one worker and one of two: each still reads the other's blocks
        sizes = replay_engines(chats.limited(200), config, 2, "round-robin", sizes=[1, 2])
        assert all(e.tier_hits["remote"] > 0 for e in sizes.engines)
        assert "the Redis tier is counted as unbounded" in " ".join(rr.bounds.assumptions)
    finally:
        server.kill()
