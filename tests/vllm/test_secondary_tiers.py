"""kvtier's disk and Redis tiers under vLLM's real tiering manager (scheduler side).

A real `TieringOffloadingSpec` (vLLM's, with its shared-memory primary tier) loads
the tiers from their `secondary_tiers` entries through vLLM's factory. The test plays
the connector's scheduler side: stores write the primary rows and complete (vLLM
then cascades them into the tier), other stores evict them from the primary tier,
and a returning prompt is looked up step by step (RETRY and HIT_PENDING until the
promotion is in) and read back from the primary rows. No engine, no sleeps: each
step waits for the tier's jobs and lookups to end.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.remote.conftest import RedisServer, serve_redis
from tests.vllm.needs_vllm import quiet, require_vllm
from tests.vllm.offloading_config import offloading_config

require_vllm()

with quiet():
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.tiering.base import JobResult
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvtier.vllm.tiering.secondary_tiers import KvtierDiskTier, KvtierRedisTier


ROW = 4096  # bytes of one chunk in the primary tier (one page)
PRIMARY_CHUNKS = 8


def make_spec(tiers: list[dict[str, Any]], model: str = "tiny-llama") -> TieringOffloadingSpec:
    extra = {"cpu_bytes_to_use": PRIMARY_CHUNKS * ROW, "secondary_tiers": tiers}
    return TieringOffloadingSpec(offloading_config(extra, kv_bytes_per_block=ROW, model=model))


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def payloads(keys: list[bytes], seed: int = 0) -> dict[bytes, bytes]:
    rng = np.random.default_rng(seed)
    return {k: rng.integers(0, 256, ROW, dtype=np.uint8).tobytes() for k in keys}


class Scheduler:
    """vLLM's tiering manager, driven as the offloading connector's scheduler drives it."""

    def __init__(self, spec: TieringOffloadingSpec) -> None:
        self.manager: Any = spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.results: list[JobResult] = []
        finished = self.tier.get_finished_jobs
        self.tier.get_finished_jobs = lambda: self._record(finished())
        self._requests = itertools.count()

    def _record(self, results: Any) -> list[JobResult]:
        results = list(results)
        self.results.extend(results)
        return results

    def request(self) -> ReqContext:
        ctx = ReqContext(req_id=f"r{next(self._requests)}")
        self.manager.on_new_request(ctx)
        return ctx

    def end_step(self) -> None:
        """The step's end, then everything it started: jobs and lookups."""
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        self.tier.drain_jobs()
        if isinstance(self.tier, KvtierRedisTier):
            assert self.tier.lookups.wait(timeout=30)

    def store(self, data: dict[bytes, bytes]) -> list[bytes]:
        """GPU -> primary (the worker's copy, done here by hand); vLLM cascades on complete."""
        ctx = self.request()
        out = self.manager.prepare_store(list(data), ctx)
        assert out is not None
        for k, chunk in zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True):
            self.rows[chunk] = np.frombuffer(data[k], dtype=np.uint8)
        if out.keys_to_store:  # (as the connector: no job, no completion)
            self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        self.end_step()
        self.end_step()  # the cascades' completions are processed
        return list(out.evicted_keys)

    def fetch(self, keys: list[bytes], max_steps: int = 8) -> list[bytes]:
        """A returning prompt: look up until every answer is final, then load the hits
        from the primary rows (what the worker would copy to the GPU)."""
        ctx = self.request()
        for _ in range(max_steps):
            answers = []
            for k in keys:  # as vLLM's scheduler: past RETRY, up to the first miss
                answers.append(self.manager.lookup(k, ctx))
                if answers[-1] is LookupResult.MISS:
                    break
            if LookupResult.RETRY not in answers and LookupResult.HIT_PENDING not in answers:
                break
            self.end_step()
        hits = next((i for i, a in enumerate(answers) if a is not LookupResult.HIT), len(answers))
        spec = self.manager.prepare_load(keys[:hits], ctx)
        got = [self.rows[c].tobytes() for c in spec.block_ids.tolist()]
        self.manager.complete_load(keys[:hits], ctx)
        self.manager.on_request_finished(ctx)
        self.end_step()
        return got

    def in_primary(self, k: bytes) -> bool:
        return self.manager.primary_tier.lookup(k, ReqContext("probe")) is LookupResult.HIT

    def close(self) -> None:
        if hasattr(self, "rows"):
            del self.rows  # a view of the primary rows: vLLM unmaps them at shutdown
            self.manager.shutdown()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from serve_redis(tmp_path)


def disk_entry(path: Path, **options: Any) -> dict[str, Any]:
    entry = {"type": "KvtierDiskTier", "module_path": "kvtier.vllm", "path": str(path)}
    return {"bytes_to_use": 64 * (ROW + 200), **entry, **options}


def redis_entry(url: str, **options: Any) -> dict[str, Any]:
    return {"type": "KvtierRedisTier", "module_path": "kvtier.vllm", "url": url, **options}


@pytest.fixture
def open_scheduler(caplog: pytest.LogCaptureFixture) -> Iterator[Any]:
    # pytest keeps a test's log records, and the exception in a failed job's warning
    # keeps its frames, views of the primary rows among them, alive: not those records
    caplog.set_level(logging.ERROR, logger="kvtier")
    opened: list[Scheduler] = []

    def make(entry: dict[str, Any]) -> Scheduler:
        opened.append(Scheduler(make_spec([entry])))
        return opened[-1]

    yield make
    for scheduler in opened:
        scheduler.close()
    # the tiers let go of the primary rows, so vLLM unmapped them
    assert not [r for r in caplog.records if "Failed to close" in r.getMessage()]


PROMPT = [key(i) for i in range(4)]
OTHER = [key(100 + i) for i in range(PRIMARY_CHUNKS)]


def evict_from_primary(scheduler: Scheduler) -> None:
    evicted = scheduler.store(payloads(OTHER, seed=1))
    assert set(PROMPT) <= set(evicted)
    assert not any(scheduler.in_primary(k) for k in PROMPT)


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_stores_cascade_and_promotions_bring_the_same_bytes_back(
    tier: str, tmp_path: Path, request: pytest.FixtureRequest, open_scheduler: Any
) -> None:
    if tier == "disk":
        entry = disk_entry(tmp_path)
    else:
        entry = redis_entry(request.getfixturevalue("redis_server").url)
    scheduler = open_scheduler(entry)
    data = payloads(PROMPT)
    scheduler.store(data)
    evict_from_primary(scheduler)
    cascaded = len(scheduler.results)
    assert scheduler.fetch(PROMPT) == [data[k] for k in PROMPT]
    promotions = [(r.success, r.transfer_bytes) for r in scheduler.results[cascaded:]]
    assert promotions == [(True, 4 * ROW)]  # the bytes came from the tier, in one job


def test_another_engine_reads_the_redis_tier(
    redis_server: RedisServer, open_scheduler: Any
) -> None:
    first, second = open_scheduler(redis_entry(redis_server.url)), None
    data = payloads(PROMPT)
    first.store(data)
    second = open_scheduler(redis_entry(redis_server.url))
    assert second.fetch(PROMPT) == [data[k] for k in PROMPT]
    # an engine of another model shares the server, never the blocks
    third = Scheduler(make_spec([redis_entry(redis_server.url)], model="another-model"))
    try:
        assert third.fetch(PROMPT) == []
    finally:
        third.close()


def test_a_restarted_engine_finds_the_disk_tier(tmp_path: Path, open_scheduler: Any) -> None:
    data = payloads(PROMPT)
    first = open_scheduler(disk_entry(tmp_path))
    first.store(data)
    first.close()
    second = open_scheduler(disk_entry(tmp_path))
    assert second.fetch(PROMPT) == [data[k] for k in PROMPT]


def test_a_killed_redis_turns_into_misses(redis_server: RedisServer, open_scheduler: Any) -> None:
    scheduler = open_scheduler(redis_entry(redis_server.url))
    scheduler.store(payloads(PROMPT))
    evict_from_primary(scheduler)
    redis_server.kill()
    assert scheduler.fetch(PROMPT) == []
    scheduler.store(payloads([key(200)], seed=2))  # stores fail quietly too
    assert scheduler.fetch([key(200)]) != []  # (still served by the primary tier)


def test_redis_killed_between_lookup_and_load(
    redis_server: RedisServer, open_scheduler: Any
) -> None:
    scheduler = open_scheduler(redis_entry(redis_server.url))
    scheduler.store(payloads(PROMPT))
    evict_from_primary(scheduler)
    ctx = scheduler.request()
    assert scheduler.manager.lookup(PROMPT[0], ctx) is LookupResult.RETRY
    scheduler.end_step()
    assert scheduler.manager.lookup(PROMPT[0], ctx) is LookupResult.HIT_PENDING  # promoting
    redis_server.kill()
    scheduler.end_step()  # the load is submitted, and fails
    assert scheduler.manager.lookup(PROMPT[0], ctx) is LookupResult.MISS
    assert [r.success for r in scheduler.results[-1:]] == [False]
    assert not scheduler.in_primary(PROMPT[0])
    scheduler.manager.on_request_finished(ctx)


def test_a_corrupt_block_file_turns_into_a_miss(tmp_path: Path, open_scheduler: Any) -> None:
    scheduler = open_scheduler(disk_entry(tmp_path))
    tier: KvtierDiskTier = scheduler.tier
    data = payloads(PROMPT)
    scheduler.store(data)
    evict_from_primary(scheduler)
    path = tier.store.directory / f"{tier.key(PROMPT[1]).hex()}.kv"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # one bit pattern in the payload
    path.write_bytes(raw)

    assert scheduler.fetch(PROMPT) == [data[PROMPT[0]]]  # up to the corrupt block
    partial = [r for r in scheduler.results if not r.success]
    assert len(partial) == 1
    assert set(partial[0].successful_keys or ()) == {PROMPT[0], PROMPT[2], PROMPT[3]}
    assert tier.store.stats().checksum_failures == 1
    assert not path.exists()
    assert not scheduler.in_primary(PROMPT[1])
    assert tier.lookup(PROMPT[1], ReqContext("probe")) is LookupResult.MISS
    assert all(scheduler.in_primary(k) for k in (PROMPT[0], PROMPT[2], PROMPT[3]))


def test_the_disk_tier_stays_within_its_bytes(tmp_path: Path, open_scheduler: Any) -> None:
    scheduler = open_scheduler(disk_entry(tmp_path, bytes_to_use=3 * (ROW + 100)))
    tier: KvtierDiskTier = scheduler.tier
    data = payloads(PROMPT)
    scheduler.store({k: data[k] for k in PROMPT[:2]})
    scheduler.store({k: data[k] for k in PROMPT[2:]})  # evicts the least recent block
    stats = tier.store.stats()
    assert stats.num_blocks == 3
    assert stats.used_bytes <= 3 * (ROW + 100)
    assert len(list(tier.store.directory.glob("*.kv"))) == 3
    ctx = ReqContext("probe")
    assert [tier.lookup(k, ctx) for k in PROMPT] == [LookupResult.MISS] + [LookupResult.HIT] * 3


def test_options_are_checked_at_start(tmp_path: Path, redis_server: RedisServer) -> None:
    bad = [
        (disk_entry(tmp_path, colour="red"), r"KvtierDiskTier: unknown option 'colour'.*allowed"),
        (
            {"type": "KvtierDiskTier", "module_path": "kvtier.vllm", "path": str(tmp_path)},
            r"option 'bytes_to_use' is required",
        ),
        (disk_entry(tmp_path, eviction_policy="fifo2"), r"unknown cache policy 'fifo2'"),
        (redis_entry(redis_server.url, timeout=1), r"unknown option 'timeout'.*socket_timeout_s"),
        (
            redis_entry(redis_server.url, breaker={"threshold": 2}),
            r"unknown breaker option 'threshold'.*failure_threshold",
        ),
        (redis_entry(redis_server.url, locality="MARS"), r"locality must be one of"),
    ]
    for entry, message in bad:
        with pytest.raises(ValueError, match=message):
            make_spec([entry]).get_manager()


def test_locality_and_options_reach_the_tier(
    tmp_path: Path, redis_server: RedisServer, open_scheduler: Any
) -> None:
    redis = open_scheduler(
        redis_entry(redis_server.url, locality="LOCAL", socket_timeout_s=0.5, cluster_nodes=[])
    ).tier
    assert redis.locality is Locality.LOCAL
    assert redis.remote.store.config.socket_timeout_s == 0.5
    assert open_scheduler(redis_entry(redis_server.url)).tier.locality is Locality.REMOTE
    disk = open_scheduler(disk_entry(tmp_path, eviction_policy="arc", fsync=False)).tier
    assert disk.locality is Locality.LOCAL
    assert type(disk.manager.policy).__name__ == "ARCCachePolicy"


def test_shutdown_releases_threads(redis_server: RedisServer, tmp_path: Path) -> None:
    before = {t.name for t in threading.enumerate()}
    for entry in (disk_entry(tmp_path), redis_entry(redis_server.url)):
        scheduler = Scheduler(make_spec([entry]))
        scheduler.store(payloads(PROMPT))
        scheduler.fetch(PROMPT)
        scheduler.close()
    assert {t.name for t in threading.enumerate()} - before == set()
