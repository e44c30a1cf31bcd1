"""kvtier's per-tier metrics as vLLM's connector statistics (what `/metrics` shows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.remote.conftest import RedisServer, serve_redis
from tests.vllm.test_offloading_spec import BLOCK_BYTES, Engine, engines, keys_of

with_engines = engines  # the fixture, under this module's name too

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

from kvtier.offload.tier_metrics import METRICS  # noqa: E402
from kvtier.vllm.offloading.offloading_spec import KvtierOffloadingSpec  # noqa: E402


def by_tier(stats: Any, key: str) -> dict[str, float]:
    values = stats.data["data"].get(METRICS[key].name, {})
    return {labels[0]: value for labels, value in values.items()}


def test_every_metric_is_defined_for_vllm_with_a_tier_label() -> None:
    definitions = KvtierOffloadingSpec.build_metric_definitions({})
    for metric in METRICS.values():
        assert definitions[metric.name].labelnames == ("tier",)
        assert metric.name.startswith("vllm:kvtier_") and not metric.name.endswith("_total")


def test_stats_count_each_tier_and_report_increments(engines: list[Engine], tmp_path: Path) -> None:
    server_cm = serve_redis(tmp_path)
    server: RedisServer = next(server_cm)
    try:
        extra = {
            "cpu_bytes_to_use": 2 * BLOCK_BYTES,
            "disk_path": str(tmp_path / "disk"),
            "disk_bytes_to_use": 64 * (BLOCK_BYTES + 128),
            "redis_url": server.url,
            "disk_writes": "demote",
        }
        engine = Engine(extra)
        engines.append(engine)
        keys = keys_of(4)
        engine.compute(list(range(4)), seed=1)
        for i, key in enumerate(keys):  # two stay in CPU, two are demoted to disk
            engine.store([key], [i])
        assert engine.hits(keys) == 4
        missing = keys_of(1, start=99)[0]
        assert engine.manager.lookup(missing, engine.ctx) is LookupResult.RETRY
        assert engine.manager.remote.wait_lookups(timeout=30)
        assert engine.manager.lookup(missing, engine.ctx) is LookupResult.MISS
        engine.load(keys, [8, 9, 10, 11])

        stats = engine.manager.get_stats()
        stored = by_tier(stats, "store_blocks")
        assert stored["cpu"] >= 4 and stored["disk"] == 2 and stored["redis"] == 4
        assert by_tier(stats, "store_bytes")["redis"] == 4 * BLOCK_BYTES
        loaded = by_tier(stats, "load_blocks")
        assert loaded["cpu"] + loaded["disk"] == 4 and loaded["disk"] >= 1
        assert by_tier(stats, "lookup_blocks")["redis"] == 1  # the miss; RETRY is no answer
        assert "redis" not in by_tier(stats, "hit_blocks")
        assert by_tier(stats, "evicted_blocks")["cpu"] >= 2
        assert by_tier(stats, "used_blocks")["cpu"] == 2
        assert by_tier(stats, "capacity_blocks") == {"cpu": 2, "disk": 64}
        assert by_tier(stats, "breaker_state") == {"redis": 0}
        assert by_tier(stats, "store_time")["disk"] > 0
        lookups = stats.data["data"][METRICS["lookup_seconds"].name][("redis",)]
        assert len(lookups) == 1 and lookups[0] > 0

        again = engine.manager.get_stats()  # counters are increments: nothing new
        assert not by_tier(again, "store_blocks") and not by_tier(again, "lookup_blocks")
        assert by_tier(again, "used_blocks")["cpu"] == 2  # gauges are repeated
    finally:
        next(server_cm, None)
