"""A tier that falls behind sheds stores instead of queueing them: kvtier's worker and
scheduler side as `KvtierConnector` builds them, a real redis-server behind the shaping
proxy, stalled so that a store stays in flight."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvtier.remote.shaping_proxy import ShapingProxy
from tests.remote.conftest import serve_redis
from tests.vllm.test_offloading_spec import (
    BLOCK_BYTES,
    Engine,
    engines,
    first_demoted,
    hung_disk,
    keys_of,
)

with_engines = engines  # the fixture, under this module's name too

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult  # noqa: E402

from kvtier.offload.tier_metrics import METRICS  # noqa: E402
from kvtier.vllm.offloading.job_specs import LOCAL, REMOTE, WorkerReport  # noqa: E402
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
            queue_gauge = METRICS["store_queue_bytes"].name
            stats = engine.manager.get_stats().data["data"]
            assert stats[queue_gauge] == {("cpu",): 0, ("redis",): 0}  # there from the start
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
            assert stats[queue_gauge][("redis",)] == 2 * BLOCK_BYTES  # the first store's
            assert engine.worker.take_report().queued_bytes  # (sent while any is queued)

            proxy.resume()
            engine.worker.wait_finished({1})
            assert [r.job_id for r in engine.worker.get_finished()] == [1]
            report = engine.worker.take_report()
            assert report.queued_bytes == {LOCAL: 0, REMOTE: 0}  # once more, emptied
            engine.manager.apply_worker_report(report)
            engine.manager.complete_store(first, engine.ctx)
            stats = engine.manager.get_stats().data["data"]
            assert stats[queue_gauge] == {("cpu",): 0, ("redis",): 0}
            assert not engine.worker.take_report().worth_sending()  # (then no more)
            # a tensor-parallel engine's workers: the fullest one's queue
            fuller = WorkerReport(queued_bytes={LOCAL: 0, REMOTE: 3})
            emptied = WorkerReport(queued_bytes={REMOTE: 0})
            assert emptied.merge(fuller).queued_bytes == {LOCAL: 0, REMOTE: 3}
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


def staged_blocks(engine: Engine) -> int:
    """Blocks the worker holds in host rows for demotions not yet on disk."""
    handler = engine.worker._handler
    assert handler is not None
    return sum(handler._staged_demotions.values())


def test_a_stores_demotion_counts_in_the_disk_queue(engines: list[Engine], tmp_path: Path) -> None:
    """`disk_writes: demote`, the CPU tier full, the disk hung: a store's demotion is
    copied out of its CPU slots into host rows and written apart. Those rows count in
    the local store queue (`disk_store_queue_bytes`), so once a demotion waits there a
    store that would take the queue past its bound is shed, its demotion with it, rather
    than staged in host memory without end (before, a demotion counted nothing)."""
    engine, hung = hung_disk(
        engines,
        tmp_path,
        cpu_blocks=4,
        disk_blocks=64,
        disk_writes="demote",
        disk_store_queue_bytes=4 * BLOCK_BYTES,
    )
    hung.set()
    try:
        groups = [keys_of(2, start=750 + 2 * i) for i in range(4)]
        engine.compute(list(range(8)), seed=8)
        engine.store(groups[0], [0, 1])
        engine.store(groups[1], [2, 3])  # the CPU tier is full
        hung.clear()
        watchdog = threading.Timer(120, hung.set)  # (a flush that waited would hang)
        watchdog.start()
        submit_store(engine, 10, groups[2], [4, 5])  # evicts groups[0]: demoted, hangs
        engine.worker.wait({10})  # the flush: the copy is done
        assert engine.worker.get_finished() == []  # the job waits for its demotion
        engine.manager.apply_worker_report(engine.worker.take_report())
        assert staged_blocks(engine) == 2
        submit_store(engine, 11, groups[3], [6, 7])  # evicts groups[1]: 2 + 2 + 2 > 4
        engine.worker.wait({11})
        assert [(r.job_id, r.success) for r in engine.worker.get_finished()] == [(11, True)]
        report = engine.worker.take_report()
        assert report.shed_stores == {LOCAL: [k[:-4] for k in groups[3]]}
        assert report.lost_demotions == [k[:-4] for k in groups[1]]
        assert staged_blocks(engine) == 2  # the shed store's demotion never staged
        engine.manager.apply_worker_report(report)
        engine.manager.complete_store(groups[3], engine.ctx)
        stats = engine.manager.get_stats().data["data"]
        assert stats[METRICS["shed_blocks"].name] == {("disk",): 2}
        hung.set()
        watchdog.cancel()
        ok, _ = engine.run(10)
        assert ok
        engine.manager.complete_store(groups[2], engine.ctx)
        assert staged_blocks(engine) == 0
        assert engine.hits(groups[0]) == 2  # on disk
        assert engine.hits(groups[1]) == 0  # lost with the shed store: forgotten
        assert engine.hits(groups[2]) == 2  # in the CPU tier
    finally:  # a failure above must not leave the disk hung for the teardown
        hung.set()


def test_a_loads_demotion_counts_in_the_disk_queue(engines: list[Engine], tmp_path: Path) -> None:
    """A disk hit promoted into a full CPU tier demotes a block, written apart so the
    request waits for its load only. Its host rows count in the local store queue too:
    with the disk hung and a demotion already waiting, the next promotion's demotion
    is shed (its block lost from the disk tier, reported), the load itself served."""
    engine, hung = hung_disk(
        engines,
        tmp_path,
        cpu_blocks=2,
        disk_blocks=64,
        disk_writes="demote",
        disk_store_queue_bytes=BLOCK_BYTES,
    )
    try:
        first, second, data, watchdog = first_demoted(engine, hung, start=770, seed=9)
        errors, report = engine.load(first[:1], [10])  # promoted: second[0] demoted
        assert not errors and not report.lost_demotions
        assert staged_blocks(engine) == 1
        errors, report = engine.load(first[1:], [11])  # second[1]'s demotion: shed
        assert not errors and not report.failed_loads
        assert report.lost_demotions == [second[1][:-4]]  # (the scheduler forgets it)
        assert [engine.block_bytes(i) for i in (10, 11)] == [data[0], data[1]]
        assert staged_blocks(engine) == 1  # its rows let go at once
        hung.set()
        watchdog.cancel()
        engine.worker.flush_to_disk()  # (it waits for every disk write first)
        assert staged_blocks(engine) == 0
        errors, report = engine.load(second[:1], [12])  # written at last
        assert not errors and engine.block_bytes(12) == data[2]
        assert engine.manager.lookup(second[1], engine.ctx) is not LookupResult.HIT
    finally:
        hung.set()


def test_a_demotion_whose_write_fails_is_forgotten(engines: list[Engine], tmp_path: Path) -> None:
    """A store's demotion written apart fails on the disk: the worker reports its blocks
    lost while the store's job is still in flight, when the scheduler still pins them
    (a demotion is readable on disk at once). They are forgotten once the store
    completes; before, the scheduler kept offering them and their load failed."""
    engine, hung = hung_disk(engines, tmp_path, cpu_blocks=2, disk_blocks=64, disk_writes="demote")
    try:
        first, second = keys_of(2, start=790), keys_of(2, start=792)
        hung.set()
        engine.compute([0, 1, 2, 3], seed=11)
        engine.store(first, [0, 1])

        def fail(kind: str) -> None:
            if kind == "write":
                raise OSError("injected: the disk refuses the write")

        assert engine.worker.disk is not None
        engine.worker.disk.io_hook = fail
        engine.store(second, [2, 3])  # first demoted: its write fails (the store does not)
        assert engine.hits(second) == 2
        assert engine.hits(first) == 0  # lost: not offered from a disk that lacks it
    finally:
        hung.set()
