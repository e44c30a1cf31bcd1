"""A tier that falls behind sheds stores instead of queueing them: kvtier's worker and
scheduler side as `KvtierConnector` builds them, a real redis-server behind the shaping
proxy, stalled so that a store stays in flight."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvtier.remote.shaping_proxy import ShapingProxy
from tests.remote.conftest import serve_redis
from tests.vllm.test_offloading_spec import BLOCK_BYTES, Engine, engines, keys_of

with_engines = engines  # the fixture, under this module's name too

from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402

from kvtier.offload.tier_metrics import METRICS  # noqa: E402
from kvtier.vllm.offloading.job_specs import REMOTE  # noqa: E402
from kvtier.vllm.offloading.offloading_spec import KvtierOffloadingSpec  # noqa: E402
from tests.vllm.test_offloading_spec import spec_config  # noqa: E402


def submit_store(engine: Engine, job: int, keys: list[bytes], device_ids: list[int]) -> None:
    out = engine.manager.prepare_store(keys, engine.ctx)
    assert out is not None and out.keys_to_store == keys
    gpu = GPULoadStoreSpec(device_ids, [len(device_ids)], [0])
    engine.worker.submit_store(job, gpu, out.store_spec)


def test_a_tier_behind_sheds_stores_and_counts_them(engines: list[Engine], tmp_path: Path) -> None:
    servers = serve_redis(tmp_path)
    server = next(servers)
    try:
        with ShapingProxy(("127.0.0.1", server.port)) as proxy:
            extra = {
                "cpu_bytes_to_use": 8 * BLOCK_BYTES,
                "redis_url": proxy.url,
                "redis_socket_timeout_s": 60.0,  # a stalled store stays in flight
                "redis_store_queue_bytes": 2 * BLOCK_BYTES,
            }
            engine = Engine(extra)
            engines.append(engine)
            first, second = keys_of(2, start=700), keys_of(2, start=710)
            engine.compute([0, 1, 2, 3], seed=5)
            proxy.stall()
            submit_store(engine, 1, first, [0, 1])  # takes Redis's whole queue
            submit_store(engine, 2, second, [2, 3])  # Redis is behind: shed
            engine.worker.wait({2})  # done at once: its CPU part only
            (result,) = engine.worker.get_finished()
            assert (result.job_id, result.success) == (2, True)  # never an error
            report = engine.worker.take_report()
            assert report.shed_stores == {REMOTE: [k[:-4] for k in second]}
            engine.manager.apply_worker_report(report)
            engine.manager.complete_store(second, engine.ctx)
            stats = engine.manager.get_stats().data["data"]
            assert stats[METRICS["shed_blocks"].name] == {("redis",): 2}
            assert ("redis",) not in stats.get(METRICS["store_failures"].name, {})

            proxy.resume()
            engine.worker.wait_finished({1})
            assert [r.job_id for r in engine.worker.get_finished()] == [1]
            engine.manager.complete_store(first, engine.ctx)
            reader = Engine({"cpu_bytes_to_use": 8 * BLOCK_BYTES, "redis_url": server.url})
            engines.append(reader)
            for k in first + second:  # asked in the background
                reader.manager.remote.lookup([k[:-4]])
            assert reader.manager.remote.wait_lookups(timeout=30)
            found = [reader.manager.remote.lookup([k[:-4]]) for k in first + second]
            assert found == [1, 1, 0, 0]  # the first store reached Redis, the shed one not
            assert engine.hits(second) == 2  # the CPU tier kept its part
    finally:
        next(servers, None)


def test_a_slow_redis_store_frees_the_engines_blocks_at_once(
    engines: list[Engine], tmp_path: Path
) -> None:
    """vLLM waits for a store's job before it reuses the job's blocks (its flush:
    `worker.wait`). A Redis store copies its blocks into host memory when submitted, so
    that flush returns while Redis is stalled, the engine overwrites the blocks, and
    Redis still gets the blocks as they were; the copies stay within the Redis store
    queue's bound (a store past it is shed)."""
    servers = serve_redis(tmp_path)
    server = next(servers)
    try:
        with ShapingProxy(("127.0.0.1", server.port)) as proxy:
            extra = {
                "cpu_bytes_to_use": 8 * BLOCK_BYTES,
                "redis_url": proxy.url,
                "redis_socket_timeout_s": 60.0,
                "redis_store_queue_bytes": 2 * BLOCK_BYTES,
            }
            engine = Engine(extra)
            engines.append(engine)
            first, second = keys_of(2, start=750), keys_of(2, start=760)
            data = engine.compute([0, 1], seed=8)
            proxy.stall()
            submit_store(engine, 1, first, [0, 1])
            flush = threading.Thread(target=engine.worker.wait, args=({1},), daemon=True)
            flush.start()
            flush.join(timeout=30)
            assert not flush.is_alive()  # the blocks are free while Redis is stalled
            assert 1 not in [r.job_id for r in engine.worker.get_finished()]  # not stored yet
            engine.compute([0, 1], seed=9)  # the engine reuses them
            engine.compute([2, 3], seed=10)
            submit_store(engine, 2, second, [2, 3])  # past the bound: shed from Redis
            assert engine.worker.take_report().shed_stores == {REMOTE: [k[:-4] for k in second]}

            proxy.resume()
            engine.worker.wait_finished({1, 2})
            results = engine.worker.get_finished()
            assert sorted((r.job_id, r.success) for r in results) == [(1, True), (2, True)]
            engine.manager.complete_store(first, engine.ctx)
            reader = Engine({"cpu_bytes_to_use": 8 * BLOCK_BYTES, "redis_url": server.url})
            engines.append(reader)
            for k in first:
                reader.manager.lookup(k, reader.ctx)
            assert reader.manager.remote.wait_lookups(timeout=30)
            assert reader.hits(first) == 2
            errors, _ = reader.load(first, [4, 5])
            assert not errors
            assert [reader.block_bytes(i) for i in (4, 5)] == list(data.values())
    finally:
        next(servers, None)


def test_an_empty_queue_takes_a_store_larger_than_its_bound(engines: list[Engine]) -> None:
    engine = Engine({"cpu_bytes_to_use": 8 * BLOCK_BYTES, "cpu_store_queue_bytes": 1})
    engines.append(engine)
    keys = keys_of(3, start=720)
    engine.compute([0, 1, 2], seed=6)
    assert engine.store(keys, [0, 1, 2]) == keys  # not behind: stored
    assert engine.hits(keys) == 3


@pytest.mark.parametrize(
    "key", ["cpu_store_queue_bytes", "disk_store_queue_bytes", "redis_store_queue_bytes"]
)
@pytest.mark.parametrize("value", [-1, 0, "big", 1.5])
def test_a_bad_queue_bound_names_the_key(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{key}.*must be an integer >= 1"):
        KvtierOffloadingSpec(spec_config({"cpu_bytes_to_use": 1 << 20, key: value}))


def test_under_vllms_own_connector_nothing_is_shed(engines: list[Engine], tmp_path: Path) -> None:
    """vLLM's OffloadingConnector has no way to hear of a shed store (its blocks would
    be made readable with nothing in their slots): the worker sheds none there."""
    servers = serve_redis(tmp_path)
    server = next(servers)
    try:
        with ShapingProxy(("127.0.0.1", server.port)) as proxy:
            extra = {
                "cpu_bytes_to_use": 8 * BLOCK_BYTES,
                "redis_url": proxy.url,
                "redis_socket_timeout_s": 60.0,
                "redis_store_queue_bytes": 2 * BLOCK_BYTES,
            }
            engine = Engine(extra)
            engines.append(engine)
            engine.worker.report_failures = False  # as under vLLM's own connector
            first, second = keys_of(2, start=730), keys_of(2, start=740)
            engine.compute([0, 1, 2, 3], seed=7)
            proxy.stall()
            submit_store(engine, 1, first, [0, 1])
            submit_store(engine, 2, second, [2, 3])
            assert not engine.worker.take_report().shed_stores
            proxy.resume()
            engine.worker.wait_finished({1, 2})
            results = engine.worker.get_finished()
            assert sorted((r.job_id, r.success) for r in results) == [(1, True), (2, True)]
    finally:
        next(servers, None)
