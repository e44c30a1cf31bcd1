"""Two engine processes sharing one Redis, and a replay that survives a dead server."""

from __future__ import annotations

import json
import subprocess
import sys

from kvtier.remote.breaker import BreakerConfig, BreakerState
from kvtier.remote.remote_manager import RemoteOffloadingManager
from kvtier.remote.tier import RemoteTier
from kvtier.sim.traces import TraceRequest
from kvtier.types import BlockHash, int_block_hash
from tests.remote.conftest import REPO_ROOT, FakeClock, RedisServer


def peer(*args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.remote.peer", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_blocks_stored_by_one_process_are_hits_for_another(redis_server: RedisServer) -> None:
    assert peer("lookup", redis_server.url, "20") == {"hits": 0, "intact": True, "loaded": 0}
    assert peer("store", redis_server.url, "12") == {"stored": True}
    assert peer("lookup", redis_server.url, "20") == {"hits": 12, "intact": True, "loaded": 12}


def replay(manager: RemoteOffloadingManager, requests: list[TraceRequest]) -> tuple[int, list[int]]:
    """lookup -> load the hits -> touch -> store the rest -> complete; per-request hits."""
    per_request = []
    for request in requests:
        hashes: list[BlockHash] = [int_block_hash(i) for i in request.hash_ids]
        hit = manager.lookup(hashes) or 0
        if hit:
            manager.prepare_load(hashes[:hit])
            manager.complete_load(hashes[:hit])
        manager.touch(hashes)
        out = manager.prepare_store(hashes[hit:])
        if out is not None:
            manager.complete_store(out.block_hashes_to_store)
        per_request.append(hit)
    return sum(per_request), per_request


def prefix_hits_unbounded(requests: list[TraceRequest]) -> list[int]:
    """The same replay against an in-memory set: what an unbounded Redis must answer."""
    seen: set[int] = set()
    hits = []
    for request in requests:
        ids = request.hash_ids
        hit = next((i for i, h in enumerate(ids) if h not in seen), len(ids))
        seen.update(ids)
        hits.append(hit)
    return hits


def test_replay_survives_a_killed_server(
    redis_server: RedisServer, conversation_trace: list[TraceRequest]
) -> None:
    requests = conversation_trace[:900]
    first, dead, after = requests[:300], requests[300:600], requests[600:]
    clock = FakeClock()
    tier = RemoteTier.from_url(
        redis_server.url,
        FP_REPLAY,
        block_size=512,
        clock=clock,
        breaker=BreakerConfig(failure_threshold=3, reset_timeout_s=30.0),
    )
    manager = tier.manager(synthetic_payload_bytes=128)
    hits, per_request = replay(manager, first)
    assert per_request == prefix_hits_unbounded(first)  # Redis agrees with the model exactly
    assert hits == GOLDEN_FIRST_300_HITS
    redis_server.kill()
    dead_hits, _ = replay(manager, dead)  # nothing raises
    assert dead_hits == 0 and tier.store.breaker.state is BreakerState.OPEN
    assert tier.stats.errors == 3  # then every call was skipped, not timed out
    redis_server.start()  # empty: the cache warms up again
    clock.advance(30.0)
    after_hits, _ = replay(manager, after)
    assert tier.store.breaker.state is BreakerState.CLOSED
    assert after_hits == sum(prefix_hits_unbounded(after))
    assert after_hits > 0
    stats = tier.stats
    assert stats.breaker_opened == 1 and stats.loaded_blocks == hits + after_hits
    assert stats.loaded_bytes == 128 * stats.loaded_blocks
    tier.close()


FP_REPLAY = "replay|mooncake|block=512"
# prefix hits of the first 300 Mooncake requests (of 8,490 block
# references), cross-checked against the in-memory model above
GOLDEN_FIRST_300_HITS = 676


def test_kvtier_replay_finishes_when_the_server_dies_half_way(redis_server: RedisServer) -> None:
    """The real replay (`kvtier replay --redis`), its server SIGKILLed mid-run."""
    from kvtier.sim.generator import GeneratorConfig, generate_workload
    from kvtier.sim.replay_config import PROGRESS_EVERY, ReplayConfig
    from kvtier.sim.run import replay

    small = GeneratorConfig(  # short prompts: many requests, few blocks, a quick test
        num_requests=PROGRESS_EVERY + 400,
        system_prompt_blocks=4,
        tool_preamble_blocks=8,
        mean_message_blocks=2.0,
        mean_answer_blocks=2.0,
        mean_tool_result_blocks=2.0,
        mean_document_blocks=12.0,
    )
    workload = generate_workload(small, seed=5)
    config = ReplayConfig("lru", cpu_blocks=40, redis_url=redis_server.url)
    healthy = replay(workload, config)

    def kill_half_way(done: int) -> None:
        if done >= PROGRESS_EVERY and redis_server.proc is not None:
            redis_server.kill()

    broken = replay(workload, config, kill_half_way)  # nothing raises
    assert redis_server.proc is None  # it did die mid-run
    remote_healthy, remote_broken = healthy.tiers[1], broken.tiers[1]
    assert 0 < remote_broken.hit_blocks < remote_healthy.hit_blocks
    assert broken.prefix_hit_blocks < healthy.prefix_hit_blocks
    assert remote_broken.bytes_loaded < remote_healthy.bytes_loaded
