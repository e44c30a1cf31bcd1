"""A Redis store of blocks that the same job puts in the CPU tier is written from the
CPU slots once they are filled, not from a copy of the engine's blocks of its own:
kvtier's worker and scheduler side as `KvtierConnector` builds them, a real
redis-server behind the shaping proxy (stalled, so that a store stays in flight)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.remote.shaping_proxy import ShapingProxy
from tests.remote.conftest import serve_redis
from tests.vllm.test_offloading_spec import BLOCK_BYTES, Engine, engines, keys_of

with_engines = engines  # the fixture, under this module's name too

from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402

from kvtier.vllm.offloading.job_specs import LOCAL, REMOTE  # noqa: E402
from tests.vllm.test_store_queues import submit_store  # noqa: E402

EXTRA = {
    "cpu_bytes_to_use": 8 * BLOCK_BYTES,
    "redis_socket_timeout_s": 60.0,  # a stalled store stays in flight
    "redis_store_queue_bytes": 4 * BLOCK_BYTES,
}


def snapshots(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The blocks of each copy the worker takes of the engine's blocks for Redis."""
    stager = engine.worker._stager
    assert stager is not None
    taken: list[int] = []
    snapshot = stager.snapshot

    def counted(device_ids: Any) -> Any:
        taken.append(len(device_ids))
        return snapshot(device_ids)

    monkeypatch.setattr(stager, "snapshot", counted)
    return taken


def read_back(server_url: str, keys: list[bytes], device_ids: list[int]) -> list[bytes]:
    """The blocks as another engine loads them from Redis."""
    reader = Engine({"cpu_bytes_to_use": 8 * BLOCK_BYTES, "redis_url": server_url})
    try:
        for k in keys:
            reader.manager.lookup(k, reader.ctx)
        assert reader.manager.remote.wait_lookups(timeout=30)
        assert reader.hits(keys) == len(keys)
        errors, _ = reader.load(keys, device_ids)
        assert not errors
        return [reader.block_bytes(i) for i in device_ids]
    finally:
        reader.close()


def test_blocks_the_cpu_tier_takes_reach_redis_from_its_slots(
    engines: list[Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis stalled: the flush returns once the CPU copy is done, the engine rewrites
    its blocks, and Redis still gets them as they were, with no copy taken for it;
    blocks already in the CPU tier (a store Redis shed) are copied for Redis as before."""
    servers = serve_redis(tmp_path)
    server = next(servers)
    try:
        with ShapingProxy(("127.0.0.1", server.port)) as proxy:
            engine = Engine({**EXTRA, "redis_url": proxy.url})
            engines.append(engine)
            taken = snapshots(engine, monkeypatch)
            first, second, third = keys_of(4, start=800), keys_of(2, start=810), keys_of(2, 820)
            data = engine.compute([0, 1, 2, 3], seed=11)
            proxy.stall()
            submit_store(engine, 1, first, [0, 1, 2, 3])  # Redis's whole queue
            engine.worker.wait({1})  # vLLM's flush: the CPU copy only
            assert taken == []  # Redis's part waits for the CPU slots
            shed = engine.compute([4, 5], seed=12)
            submit_store(engine, 2, second, [4, 5])  # Redis is behind: shed, CPU keeps it
            engine.worker.wait({2})
            assert [(r.job_id, r.success) for r in engine.worker.get_finished()] == [(2, True)]
            assert engine.worker.take_report().shed_stores == {REMOTE: [k[:-4] for k in second]}
            engine.manager.complete_store(second, engine.ctx)  # ready in the CPU tier
            engine.compute([0, 1, 2, 3], seed=13)  # the engine reuses the blocks of job 1

            proxy.resume()
            engine.worker.wait_finished({1})
            assert [(r.job_id, r.success) for r in engine.worker.get_finished()] == [(1, True)]
            engine.manager.complete_store(first, engine.ctx)
            # the shed blocks and two new ones: Redis takes all four, the CPU tier two
            fresh = engine.compute([6, 7], seed=14)
            out = engine.manager.prepare_store(second + third, engine.ctx)
            assert out is not None and out.keys_to_store == second + third
            parts = {p.tier: p.block_hashes for p in out.store_spec.parts}
            assert parts[LOCAL] == [k[:-4] for k in third]
            assert parts[REMOTE] == [k[:-4] for k in second + third]
            engine.worker.submit_store(3, GPULoadStoreSpec([4, 5, 6, 7], [4], [0]), out.store_spec)
            engine.worker.wait_finished({3})
            assert [(r.job_id, r.success) for r in engine.worker.get_finished()] == [(3, True)]
            assert taken == [2]  # a copy of the two the CPU tier already held, no more
            engine.manager.complete_store(second + third, engine.ctx)
            expected = [*data.values(), *shed.values(), *fresh.values()]
            assert read_back(server.url, first + second + third, list(range(8))) == expected
    finally:
        next(servers, None)


def test_a_failed_cpu_copy_fails_the_redis_part_written_from_it(
    engines: list[Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slots would hold nothing: Redis is not written, both parts are reported
    failed (neither tier keeps the blocks), and Redis's queue has its room back."""
    servers = serve_redis(tmp_path)
    server = next(servers)
    try:
        engine = Engine({**EXTRA, "redis_url": server.url})
        engines.append(engine)
        handler = engine.worker.workers[LOCAL].handler

        def broken(*args: Any) -> int:
            raise OSError("injected: the CPU copy failed")

        monkeypatch.setattr(handler, "store", broken)
        keys = keys_of(2, start=830)
        engine.compute([0, 1], seed=15)
        submit_store(engine, 1, keys, [0, 1])
        ok, report = engine.run(1)
        assert ok  # under KvtierConnector a failure is reported, never an error
        hashes = [k[:-4] for k in keys]
        assert report.failed_stores == {LOCAL: hashes, REMOTE: hashes}
        assert engine.worker._store_queued[REMOTE] == 0
        engine.manager.complete_store(keys, engine.ctx)
        assert engine.hits(keys) == 0
        assert redis.Redis(port=server.port).dbsize() == 0  # nothing reached Redis
    finally:
        next(servers, None)


def test_a_store_larger_than_the_redis_queue_holds_the_engines_blocks(
    engines: list[Engine], tmp_path: Path
) -> None:
    """A Redis part past the whole queue bound is sent from the engine's blocks (not
    copied, not from slots): vLLM's flush waits for it, stalled Redis and all."""
    servers = serve_redis(tmp_path)
    server = next(servers)
    try:
        with ShapingProxy(("127.0.0.1", server.port)) as proxy:
            extra = {**EXTRA, "redis_url": proxy.url, "redis_store_queue_bytes": BLOCK_BYTES}
            engine = Engine(extra)
            engines.append(engine)
            keys = keys_of(2, start=840)
            data = engine.compute([0, 1], seed=16)
            proxy.stall()
            submit_store(engine, 1, keys, [0, 1])  # an empty queue takes it whole
            flush = threading.Thread(target=engine.worker.wait, args=({1},), daemon=True)
            flush.start()
            flush.join(timeout=1.0)
            assert flush.is_alive()  # it reads the engine's blocks: they stay held
            proxy.resume()
            flush.join(timeout=60)
            assert not flush.is_alive()
            engine.worker.wait_finished({1})
            assert [(r.job_id, r.success) for r in engine.worker.get_finished()] == [(1, True)]
            engine.manager.complete_store(keys, engine.ctx)
            assert read_back(server.url, keys, [2, 3]) == list(data.values())
    finally:
        next(servers, None)
