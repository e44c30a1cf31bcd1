"""KvtierOffloadingSpec in process: its scheduler-side manager and its worker, driven as
vLLM's offloading connector drives them, over canonical KV caches made here.

Each test plays one engine (or two, sharing a disk directory or a Redis server): a
"compute" fills device blocks with random bytes, a store job copies them out, the
device blocks are overwritten, and a load job must bring the same bytes back into
other device blocks. Faults (a corrupt block file, a killed Redis) must end as a
failed load with the job's device blocks reported for recompute, and the manager
must stop offering the lost blocks. No sleeps: every step waits for its jobs.
"""

from __future__ import annotations

import gc
import itertools
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
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        LookupResult,
        Medium,
        ReqContext,
        make_offload_key,
    )

    from kvtier.store.slow_io import SlowIO
    from kvtier.vllm.offloading.job_specs import WorkerReport
    from kvtier.vllm.offloading.kvtier_connector import KvtierWorkerMetadata
    from kvtier.vllm.offloading.offloading_spec import UNDER_KVTIER_CONNECTOR, KvtierOffloadingSpec

LAYERS, TOKENS, PAGE = 2, 32, 2048  # page: one layer's K and V of one block
DEVICE_BLOCKS = 16
BLOCK_BYTES = LAYERS * PAGE


def spec_config(extra: dict[str, Any], events: bool = False) -> Any:
    extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm"} | extra
    return offloading_config(
        extra,
        kv_bytes_per_block=BLOCK_BYTES,
        num_layers=LAYERS,
        tokens_per_block=TOKENS,
        events=events,
    )


class Engine:
    """One engine's scheduler-side manager and worker (as KvtierConnector builds them)."""

    def __init__(self, extra: dict[str, Any], events: bool = False) -> None:
        token = UNDER_KVTIER_CONNECTOR.set(True)
        try:
            self.worker_spec = KvtierOffloadingSpec(spec_config(extra, events))
            self.scheduler_spec = KvtierOffloadingSpec(spec_config(extra, events))
        finally:
            UNDER_KVTIER_CONNECTOR.reset(token)
        self.pages = [torch.zeros(DEVICE_BLOCKS, PAGE, dtype=torch.int8) for _ in range(LAYERS)]
        caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, PAGE) for t in self.pages],
            [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
        )
        self.worker = self.worker_spec.get_worker(caches)  # the worker opens the disk first
        self.manager = self.scheduler_spec.get_manager()
        self.jobs = itertools.count()
        self.ctx = ReqContext(req_id="r")

    def compute(self, device_ids: list[int], seed: int) -> dict[int, bytes]:
        rng = np.random.default_rng(seed)
        for page in self.pages:
            for i in device_ids:
                page[i] = torch.from_numpy(rng.integers(-128, 128, PAGE, dtype=np.int8))
        return {i: self.block_bytes(i) for i in device_ids}

    def block_bytes(self, device_id: int) -> bytes:
        return b"".join(page[device_id].numpy().tobytes() for page in self.pages)

    def run(self, job_id: int) -> tuple[bool, Any]:
        """Wait for a job; its result and the report as the scheduler would receive it."""
        self.worker.wait_finished({job_id})
        (result,) = [r for r in self.worker.get_finished() if r.job_id == job_id]
        meta = KvtierWorkerMetadata(report=self.worker.take_report())
        if meta.report.worth_sending():  # as KvtierConnector does
            self.manager.apply_worker_report(meta.report)
        return result.success, meta.report

    def store(self, keys: list[bytes], device_ids: list[int]) -> list[bytes]:
        out = self.manager.prepare_store(keys, self.ctx)
        assert out is not None
        ids = [device_ids[keys.index(k)] for k in out.keys_to_store]
        job = next(self.jobs)
        self.worker.submit_store(job, GPULoadStoreSpec(ids, [len(ids)], [0]), out.store_spec)
        ok, _ = self.run(job)
        assert ok
        self.manager.complete_store(out.keys_to_store, self.ctx)
        return list(out.keys_to_store)

    def hits(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            if self.manager.lookup(k, self.ctx) is not LookupResult.HIT:
                break
            n += 1
        return n

    def load(self, keys: list[bytes], device_ids: list[int]) -> tuple[set[int], Any]:
        """Load into `device_ids`; the device blocks reported for recompute, and the report."""
        spec = self.manager.prepare_load(keys, self.ctx)
        job = next(self.jobs)
        self.worker.submit_load(job, spec, GPULoadStoreSpec(device_ids, [len(device_ids)], [0]))
        ok, report = self.run(job)
        assert ok  # under KvtierConnector every job completes; failures go to the report
        errors = self.worker.take_load_errors()
        self.manager.complete_load(set(keys), self.ctx)
        return errors, report

    def close(self) -> None:
        self.manager.shutdown()
        self.worker.shutdown()


def hung_disk(
    engines: list[Engine],
    path: Path,
    cpu_blocks: int,
    disk_blocks: int,
    disk_writes: str = "write_through",
    **extra: Any,
) -> tuple[Engine, threading.Event]:
    """An engine whose disk tier's writes wait for the event returned: set it in a
    `finally` (the worker's shutdown waits for the writes). `extra`: more config keys."""
    engine = Engine(
        {
            "cpu_bytes_to_use": cpu_blocks * BLOCK_BYTES,
            "disk_path": str(path),
            "disk_bytes_to_use": disk_blocks * (BLOCK_BYTES + 128),
            "disk_writes": disk_writes,
        }
        | extra
    )
    engines.append(engine)
    assert engine.worker.disk is not None
    hung = threading.Event()
    engine.worker.disk.io_hook = lambda kind: hung.wait() if kind == "write" else None
    return engine, hung


def first_demoted(
    engine: Engine, hung: threading.Event, start: int, seed: int
) -> tuple[list[bytes], list[bytes], dict[int, bytes], threading.Timer]:
    """A CPU tier of two blocks holding `second`, `first` demoted to disk from it (device
    blocks 0-3, bytes returned), then the disk's writes hung behind a watchdog that lets
    them go after 120 s (cancel it once the test sets `hung`): a load that waited for
    the disk would hang, and the test fail, instead."""
    first, second = keys_of(2, start=start), keys_of(2, start=start + 2)
    hung.set()  # the disk answers, for now
    data = engine.compute([0, 1, 2, 3], seed=seed)
    engine.store(first, [0, 1])
    engine.store(second, [2, 3])  # first demoted to disk
    hung.clear()
    watchdog = threading.Timer(120, hung.set)
    watchdog.start()
    return first, second, data, watchdog


def keys_of(n: int, start: int = 0) -> list[bytes]:
    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def test_cpu_tier_round_trip_and_events(engines: list[Engine]) -> None:
    engine = Engine({"cpu_bytes_to_use": 4 * BLOCK_BYTES}, events=True)
    engines.append(engine)
    keys = keys_of(6)
    data = engine.compute(list(range(6)), seed=1)
    engine.store(keys[:4], [0, 1, 2, 3])
    assert engine.hits(keys) == 4
    engine.store(keys[4:], [4, 5])  # evicts the two least recent (keys 0, 1)
    assert engine.hits(keys) == 0 and engine.hits(keys[2:]) == 4
    engine.compute(list(range(DEVICE_BLOCKS)), seed=2)  # the device forgets
    errors, report = engine.load(keys[2:], [9, 10, 11, 12])
    assert not errors and not report
    assert [engine.block_bytes(i) for i in (9, 10, 11, 12)] == [data[i] for i in (2, 3, 4, 5)]
    events = list(engine.manager.take_events())
    assert {e.medium for e in events} == {Medium.CPU}
    stored = [k for e in events if not e.removed for k in e.keys]
    removed = [k for e in events if e.removed for k in e.keys]
    assert stored == keys and removed == keys[:2]


def test_disk_restart_and_corrupt_block(engines: list[Engine], tmp_path: Path) -> None:
    extra = {
        "cpu_bytes_to_use": 2 * BLOCK_BYTES,
        "disk_path": str(tmp_path),
        "disk_bytes_to_use": 64 * (BLOCK_BYTES + 128),
        "disk_writes": "write_through",
    }
    first = Engine(extra)
    keys = keys_of(5)
    data = first.compute(list(range(5)), seed=3)
    first.store(keys, list(range(5)))
    first.close()

    second = Engine(extra)  # another engine, after the first exited
    engines.append(second)
    assert second.hits(keys) == 5
    errors, report = second.load(keys, list(range(10, 15)))
    assert not errors and not report
    assert [second.block_bytes(i) for i in range(10, 15)] == list(data.values())

    # corrupt one block file that is only on disk (the CPU tier holds the last two loads)
    victim = next(k for k in keys if not second.manager.local.cpu.lookup([k[:-4]]))
    files = list(tmp_path.glob(f"kvtier-*/*{victim[:-4].hex()}*"))
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    position = keys.index(victim)
    errors, report = second.load([victim], [7])
    assert errors == {7}  # vLLM recomputes from this device block
    assert report.failed_loads == [[victim[:-4]]] and report.corrupt_blocks == [victim[:-4]]
    assert second.manager.load_failures == 1
    assert second.manager.lookup(victim, second.ctx) is LookupResult.MISS  # forgotten
    assert second.hits(keys) == position


def test_redis_shared_between_engines_and_killed(engines: list[Engine], tmp_path: Path) -> None:
    server_cm = serve_redis(tmp_path)
    server: RedisServer = next(server_cm)
    try:
        extra = {"cpu_bytes_to_use": 2 * BLOCK_BYTES, "redis_url": server.url}
        writer, reader = Engine(extra), Engine(extra | {"cpu_bytes_to_use": 8 * BLOCK_BYTES})
        engines += [writer, reader]
        keys = keys_of(4, start=100)
        data = writer.compute(list(range(4)), seed=4)
        writer.store(keys, list(range(4)))

        assert reader.manager.lookup(keys[0], reader.ctx) is LookupResult.RETRY  # asked async
        assert reader.manager.remote.wait_lookups(timeout=30)
        assert reader.hits(keys[:1]) == 1
        for k in keys[1:]:
            reader.manager.lookup(k, reader.ctx)
        assert reader.manager.remote.wait_lookups(timeout=30)
        assert reader.hits(keys) == 4
        errors, _ = reader.load(keys, [8, 9, 10, 11])
        assert not errors
        assert [reader.block_bytes(i) for i in (8, 9, 10, 11)] == list(data.values())
        # promoted into the reader's CPU tier: the next hit is local, with the same bytes
        assert reader.manager.local.lookup([k[:-4] for k in keys]) == 4
        reader.compute(list(range(DEVICE_BLOCKS)), seed=7)
        spec = reader.manager.prepare_load(keys, reader.ctx)
        assert [p.tier for p in spec.parts] == ["local"]
        reader.manager.complete_load(set(keys), reader.ctx)
        errors, _ = reader.load(keys, [0, 1, 2, 3])
        assert not errors
        assert [reader.block_bytes(i) for i in range(4)] == list(data.values())

        # the server dies between the lookup and the load: a failed load, nothing raises
        more = keys_of(2, start=200)
        writer.compute([0, 1], seed=5)
        writer.store(more, [0, 1])
        for k in more:
            reader.manager.lookup(k, reader.ctx)
        assert reader.manager.remote.wait_lookups(timeout=30)
        assert reader.hits(more) == 2
        # (blocks the lookup carried would still load: `kvtier.remote.prefetch`)
        reader.manager.remote.store.prefetched.clear()
        server.kill()
        errors, report = reader.load(more, [12, 13])
        assert errors == {12, 13} and report.failed_loads == [[k[:-4] for k in more]]
        assert reader.manager.local.lookup([k[:-4] for k in more]) == 0  # nothing promoted
        writer.compute([2], seed=6)
        stored = writer.store(keys_of(1, start=300), [2])  # the CPU part still stores
        assert stored
    finally:
        next(server_cm, None)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "needs 'cpu_bytes_to_use'"),
        ({"cpu_bytes_to_use": 1 << 20, "cpu_byte_to_use": 1}, "unknown kv_connector_extra_config"),
        ({"cpu_bytes_to_use": -5}, "must be an integer >= 1, got -5"),
        ({"cpu_bytes_to_use": 1 << 20, "eviction_policy": "lfu9"}, "unknown cache policy 'lfu9'"),
        ({"cpu_bytes_to_use": 1 << 20, "disk_path": "/tmp/x"}, "but not 'disk_bytes_to_use'"),
        ({"cpu_bytes_to_use": 1 << 20, "redis_url": "http://x"}, "must start with redis://"),
        ({"cpu_bytes_to_use": 1 << 20, "max_tracker_size": 5}, "does not apply"),
        ({"cpu_bytes_to_use": 10}, "below one block of this model"),
        ({"cpu_bytes_to_use": 1 << 20, "cpu_copy_threads": 0}, "must be an integer >= 1, got 0"),
        (
            {"cpu_bytes_to_use": 1 << 20, "redis_store_threads": "4"},
            r"\['redis_store_threads'\] must be an integer >= 1, got '4'",
        ),
    ],
)
def test_bad_config_fails_at_start(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KvtierOffloadingSpec(spec_config(extra))


def test_a_bad_key_fails_while_vllm_builds_its_config() -> None:
    """vLLM asks the connector class while building its config, before any process
    starts (with full CUDA graphs: vLLM's GPU default); kvtier checks its keys there."""
    from kvtier.vllm.offloading.kvtier_connector import KvtierConnector

    extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm"}
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key 'cpu_byte"):
        KvtierConnector.requires_piecewise_for_cudagraph(extra | {"cpu_bytes": 1})
    assert not KvtierConnector.requires_piecewise_for_cudagraph(extra | {"cpu_bytes_to_use": 1})


def test_a_worker_leaves_the_startup_heap_out_of_full_collections(engines: list[Engine]) -> None:
    """vLLM freezes its engine core's heap, not its workers': kvtier's worker does (see
    `freeze_startup_heap`), so a full collection scans what was made since."""
    startup = [[]]  # a GC-tracked object alive before the worker
    engines.append(Engine({"cpu_bytes_to_use": 4 * BLOCK_BYTES}))
    later = [[]]
    tracked = gc.get_objects()  # the frozen generation is not listed
    assert not any(o is startup for o in tracked) and any(o is later for o in tracked)


def test_an_idle_step_waits_for_the_oldest_load(engines: list[Engine]) -> None:
    engine = Engine({"cpu_bytes_to_use": 4 * BLOCK_BYTES, "cpu_copy_threads": 3})
    engines.append(engine)
    engine.worker.wait_for_transfer(30)  # nothing in flight: returns at once
    keys = keys_of(4)
    data = engine.compute([0, 1, 2, 3], seed=7)
    engine.store(keys, [0, 1, 2, 3])
    spec = engine.manager.prepare_load(keys, engine.ctx)
    engine.worker.submit_load(99, spec, GPULoadStoreSpec([8, 6, 5, 4], [4], [0]))
    engine.worker.wait_for_transfer(30)
    assert [r.job_id for r in engine.worker.get_finished()] == [99]
    assert [engine.block_bytes(i) for i in (8, 6, 5, 4)] == [data[i] for i in range(4)]
    engine.manager.complete_load(set(keys), engine.ctx)


def test_an_idle_step_with_only_stores_in_flight_waits_for_the_oldest_store(
    engines: list[Engine], tmp_path: Path
) -> None:
    """Every request finished, its stores still running: the empty steps vLLM keeps
    taking until they complete wait for them instead of spinning (issue 33: a
    tensor-parallel engine's spin starved its own Redis stores until they timed out).
    The disk writes are slowed (0.3 s per block file), so a wait that returned at once
    would find the store unfinished."""
    disk = {"disk_path": str(tmp_path), "disk_bytes_to_use": 1 << 24}
    engine = Engine({"cpu_bytes_to_use": 4 * BLOCK_BYTES, **disk})
    engines.append(engine)
    assert engine.worker.disk is not None
    engine.worker.disk.io_hook = SlowIO(write_s=0.3).hook()
    keys = keys_of(2, start=40)
    engine.compute([0, 1], seed=8)
    out = engine.manager.prepare_store(keys, engine.ctx)
    assert out is not None
    engine.worker.submit_store(77, GPULoadStoreSpec([0, 1], [2], [0]), out.store_spec)
    engine.worker.wait_for_transfer(60)
    assert [(r.job_id, r.success) for r in engine.worker.get_finished()] == [(77, True)]
    engine.manager.complete_store(out.keys_to_store, engine.ctx)
    assert engine.hits(keys) == 2


def test_a_hung_disk_write_holds_back_neither_the_flush_nor_a_later_store(
    engines: list[Engine], tmp_path: Path
) -> None:
    """vLLM waits for a store's copy out of the engine's blocks before it reuses them (its
    flush, `wait`); the write-through to disk is a job of its own, so the flush returns
    while the disk hangs, and a later store's copy runs too (with both in one job on one
    thread, a disk 20 ms a block file slow made an engine 0.13x as fast as vLLM alone).
    Each job completes once its write has, and the disk then holds the bytes as they
    were at the copy, not as the engine overwrote them after the flush."""
    extra = {
        "cpu_bytes_to_use": 8 * BLOCK_BYTES,
        "disk_path": str(tmp_path),
        "disk_bytes_to_use": 64 * (BLOCK_BYTES + 128),
    }
    engine = Engine(extra)
    assert engine.worker.disk is not None
    hung = threading.Event()
    engine.worker.disk.io_hook = lambda kind: hung.wait() if kind == "write" else None
    try:
        # a flush that waited for the write would hang: the watchdog lets the disk go on
        # (and the test fail below) instead
        watchdog = threading.Timer(120, hung.set)
        watchdog.start()
        first, second = keys_of(2, start=50), keys_of(2, start=60)
        data = engine.compute([0, 1, 2, 3], seed=9)
        outs = []
        for job, keys, ids in ((80, first, [0, 1]), (81, second, [2, 3])):
            out = engine.manager.prepare_store(keys, engine.ctx)
            assert out is not None
            engine.worker.submit_store(job, GPULoadStoreSpec(ids, [2], [0]), out.store_spec)
            engine.worker.wait({job})  # the flush: the copy is done, the write hangs
            assert not hung.is_set(), "the flush waited for the disk"
            outs.append(out)
        engine.compute([0, 1, 2, 3], seed=10)  # the engine reuses its blocks
        assert engine.worker.get_finished() == []  # neither job is done before its write
        hung.set()
        watchdog.cancel()
        engine.worker.wait_finished({80, 81})
        assert [(r.job_id, r.success) for r in engine.worker.get_finished()] == [
            (80, True),
            (81, True),
        ]
        for out in outs:
            engine.manager.complete_store(out.keys_to_store, engine.ctx)
        engine.close()
        restarted = Engine(extra | {"cpu_bytes_to_use": 2 * BLOCK_BYTES})  # the disk alone
        engines.append(restarted)
        assert restarted.hits(first + second) == 4
        errors, report = restarted.load(first + second, [10, 11, 12, 13])
        assert not errors and not report
        assert [restarted.block_bytes(i) for i in (10, 11, 12, 13)] == [data[i] for i in range(4)]
    finally:  # a failure above must not leave the disk hung for the teardown
        hung.set()


def test_a_store_is_read_from_the_cpu_tier_while_its_disk_write_hangs(
    engines: list[Engine], tmp_path: Path
) -> None:
    """The write-through's disk write goes on after the copy: the worker reports the copy
    done (`WorkerReport.copied`), and the scheduler serves the blocks from the CPU tier at
    once, bytes as copied, while the job waits for the disk (found in CI: behind a disk
    20 ms a block file slow, a returning prompt was recomputed, its blocks still in
    flight)."""
    engine, hung = hung_disk(engines, tmp_path, cpu_blocks=8, disk_blocks=64)
    try:
        keys = keys_of(2, start=70)
        data = engine.compute([0, 1], seed=13)
        out = engine.manager.prepare_store(keys, engine.ctx)
        assert out is not None
        engine.worker.submit_store(90, GPULoadStoreSpec([0, 1], [2], [0]), out.store_spec)
        engine.worker.wait({90})  # the copy
        assert engine.hits(keys) == 0  # in flight until the scheduler hears of the copy
        assert engine.worker.get_finished() == []  # the job waits for its write
        report = engine.worker.take_report()
        assert sorted(report.copied) == sorted((0, bytes(k[:-4])) for k in keys)
        engine.manager.apply_worker_report(report)
        assert engine.hits(keys) == 2
        errors, load_report = engine.load(keys, [5, 6])  # from the CPU tier: no disk read
        assert not errors and not load_report.failed_loads
        assert [engine.block_bytes(i) for i in (5, 6)] == [data[0], data[1]]
        hung.set()
        engine.worker.wait_finished({90})
        assert [(r.job_id, r.success) for r in engine.worker.get_finished()] == [(90, True)]
        engine.manager.complete_store(out.keys_to_store, engine.ctx)
        assert engine.hits(keys) == 2
    finally:  # a failure above must not leave the disk hung for the teardown
        hung.set()


def test_a_demotion_to_a_disk_that_hangs_holds_back_no_flush(
    engines: list[Engine], tmp_path: Path
) -> None:
    """`disk_writes: demote` with a full CPU tier: every store evicts, and its demotion
    is its only disk write. vLLM's flush waits for the store's copy alone, and its
    blocks are read from the CPU tier from then on; the job completes once the
    demotion is on disk, and the demoted blocks are there."""
    engine, hung = hung_disk(engines, tmp_path, cpu_blocks=2, disk_blocks=64, disk_writes="demote")
    try:
        first, second = keys_of(2, start=40), keys_of(2, start=42)
        data = engine.compute([0, 1, 2, 3], seed=15)
        engine.store(first, [0, 1])  # the CPU tier has room: no disk write
        out = engine.manager.prepare_store(second, engine.ctx)  # evicts first: demoted
        assert out is not None
        # a flush that waited for the disk would hang: the watchdog lets the disk go on
        # (and the test fail here) instead
        watchdog = threading.Timer(120, hung.set)
        watchdog.start()
        engine.worker.submit_store(95, GPULoadStoreSpec([2, 3], [2], [0]), out.store_spec)
        engine.worker.wait({95})  # the flush: the copy; the demotion hangs
        assert not hung.is_set(), "the flush waited for the disk"
        assert engine.worker.get_finished() == []  # the job waits for its demotion
        engine.manager.apply_worker_report(engine.worker.take_report())  # its copy is done
        assert engine.hits(second) == 2  # so the CPU tier serves its blocks meanwhile
        hung.set()
        watchdog.cancel()
        engine.worker.wait_finished({95})
        assert [(r.job_id, r.success) for r in engine.worker.get_finished()] == [(95, True)]
        engine.manager.complete_store(out.keys_to_store, engine.ctx)
        assert not engine.worker.take_report()  # nothing failed, nothing lost
        assert engine.hits(first) == 2  # from disk
        errors, report = engine.load(first, [10, 11])
        assert not errors and not report.failed_loads
        assert [engine.block_bytes(i) for i in (10, 11)] == [data[0], data[1]]
    finally:  # a failure above must not leave the disk hung for the teardown
        hung.set()


def test_a_load_whose_promotion_demotes_to_a_disk_that_hangs_is_done_at_once(
    engines: list[Engine], tmp_path: Path
) -> None:
    """A disk hit is promoted into a full CPU tier (`disk_writes: demote`): the block it
    evicts is demoted, and the request used to wait for that disk write with its load.
    The load is done while the write hangs; the demoted block fails its load meanwhile
    (recomputed), and loads from disk once written."""
    engine, hung = hung_disk(engines, tmp_path, cpu_blocks=2, disk_blocks=64, disk_writes="demote")
    try:
        first, second, data, watchdog = first_demoted(engine, hung, start=50, seed=16)
        errors, report = engine.load(first[:1], [10])  # promoted: second[0] demoted
        assert not hung.is_set(), "the load waited for the disk"
        assert not errors and not report.failed_loads
        assert engine.block_bytes(10) == data[0]
        errors, _ = engine.load(second[:1], [11])  # its write hangs: recomputed
        assert errors == {11}
        hung.set()
        watchdog.cancel()
        engine.worker.flush_to_disk()  # (it waits for every disk write first)
        errors, report = engine.load(second[:1], [12])
        assert not errors and not report.failed_loads
        assert engine.block_bytes(12) == data[2]
    finally:  # a failure above must not leave the disk hung for the teardown
        hung.set()


def test_a_shutdown_goes_on_without_the_writes_of_a_disk_that_hangs(
    engines: list[Engine], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The flush at shutdown waits for the disk writes in flight, and the transfer
    threads for their jobs: a disk that hangs would keep the engine from ever stopping.
    Both waits have a bound; past it the CPU tier is not flushed (said in the log) and
    the threads are left to end on their own."""
    engine, hung = hung_disk(engines, tmp_path, cpu_blocks=8, disk_blocks=64)
    try:
        engine.compute([0, 1], seed=14)
        out = engine.manager.prepare_store(keys_of(2, start=75), engine.ctx)
        assert out is not None
        engine.worker.submit_store(91, GPULoadStoreSpec([0, 1], [2], [0]), out.store_spec)
        engine.worker.wait({91})  # copied; the write hangs
        engine.worker.shutdown_wait_s = 0.2
        stopping = threading.Thread(target=engine.worker.shutdown, daemon=True)
        stopping.start()
        stopping.join(60)  # (a shutdown that waited for the disk would still be here)
        assert not stopping.is_alive(), "the shutdown waited for a disk that hangs"
        assert "the CPU tier is not flushed" in caplog.text
        assert "left running" in caplog.text
        # a wait for the job, its threads given up, ends at its deadline (it spun)
        assert not engine.worker._wait_writes(lambda tier, sub: True, timeout=0.01)
    finally:  # the write (and the thread) go on once the disk does
        hung.set()


def test_a_copy_is_readable_once_every_worker_reports_it_in_this_reset_epoch(
    engines: list[Engine], tmp_path: Path
) -> None:
    """Each worker of a tensor-parallel engine copies its own shard: the blocks are
    readable once all have said so; a copy of an earlier reset epoch counts for nothing
    (the same hash stored again since holds other bytes until its own copy is done)."""
    engine = Engine(
        {"cpu_bytes_to_use": 8 * BLOCK_BYTES, "disk_path": str(tmp_path / "d")}
        | {"disk_bytes_to_use": 64 * (BLOCK_BYTES + 128)}
    )
    engines.append(engine)
    manager = engine.manager
    manager.workers = 2
    keys = keys_of(2, start=80)
    hashes = [bytes(k[:-4]) for k in keys]
    assert manager.prepare_store(keys, engine.ctx) is not None
    stale = WorkerReport(copied=[(manager.epoch - 1, h) for h in hashes])
    manager.apply_worker_report(stale.merge(WorkerReport(copied=[(manager.epoch, hashes[0])])))
    assert engine.hits(keys) == 0  # one worker of two, and a stale epoch's
    manager.apply_worker_report(WorkerReport(copied=[(manager.epoch, h) for h in hashes]))
    assert engine.hits(keys) == 1  # the first block: both workers; the second: one
    manager.complete_store(keys, engine.ctx)  # the job (its count for the second dropped)
    assert engine.hits(keys) == 2


def test_a_hung_disk_sheds_stores_once_its_writes_fill_the_queue(
    engines: list[Engine], tmp_path: Path
) -> None:
    """The disk's writes hang and stores keep coming (one block each: a two-block CPU
    tier full of stores in flight sends the rest straight to disk): once the writer's
    queue is nearly full the stores are shed, counted, never failed, and every job still
    completes once the disk goes on."""
    engine, hung = hung_disk(engines, tmp_path, cpu_blocks=2, disk_blocks=128)
    try:
        writer = engine.worker.workers["local"]
        engine.compute(list(range(DEVICE_BLOCKS)), seed=12)
        jobs = range(100, 100 + writer.max_queued_jobs + 8)
        for job in jobs:
            out = engine.manager.prepare_store(keys_of(1, start=job), engine.ctx)
            assert out is not None
            ids = [job % DEVICE_BLOCKS]
            engine.worker.submit_store(job, GPULoadStoreSpec(ids, [1], [0]), out.store_spec)
            engine.worker.wait({job})
            assert writer.writes_room() >= 1  # never a write refused
        report = engine.worker.take_report()
        assert report.failed_stores == {}
        assert 0 < len(report.shed_stores["local"]) <= 10
        hung.set()
        engine.worker.wait_finished(set(jobs))
        assert {(r.job_id, r.success) for r in engine.worker.get_finished()} == {
            (job, True) for job in jobs
        }
        assert engine.worker.take_report().failed_stores == {}
    finally:  # a failure above must not leave the disk hung for the teardown
        hung.set()


def test_an_idle_step_with_nothing_here_idles_only_while_another_worker_is_busy(
    engines: list[Engine],
) -> None:
    """Tensor parallelism: the worker that finished its part of a load first used to
    return from each empty step at once and spin, with the engine core, through vLLM's
    message queues, on the cores the other worker's Redis load needed (issue 37). With
    a job still out on another worker it idles for the step's wait; with a job of its own
    it waits for that instead; with none anywhere it returns at once."""
    engine = Engine({"cpu_bytes_to_use": 4 * BLOCK_BYTES, "cpu_copy_threads": 3})
    engines.append(engine)
    idled: list[float] = []
    engine.worker.idle = idled.append
    engine.worker.wait_for_transfer(0.005)
    assert idled == []
    engine.worker.wait_for_transfer(0.005, others=True)
    assert idled == [0.005]
    keys = keys_of(2, start=60)
    engine.compute([0, 1], seed=9)
    engine.store(keys, [0, 1])
    spec = engine.manager.prepare_load(keys, engine.ctx)
    engine.worker.submit_load(98, spec, GPULoadStoreSpec([6, 5], [2], [0]))
    engine.worker.wait_for_transfer(30, others=True)  # its own load: waits for it
    assert idled == [0.005]
    assert [r.job_id for r in engine.worker.get_finished()] == [98]
    engine.manager.complete_load(set(keys), engine.ctx)


def test_the_scheduler_tells_the_workers_whether_a_job_is_still_out() -> None:
    from types import SimpleNamespace

    from kvtier.vllm.offloading.kvtier_connector import jobs_pending

    assert not jobs_pending(SimpleNamespace(_jobs={}))
    assert jobs_pending(SimpleNamespace(_jobs={3: object()}))
    # a vLLM without the job table: its public "keep stepping" question
    assert jobs_pending(SimpleNamespace(has_pending_push_work=lambda: True))
    assert not jobs_pending(SimpleNamespace(has_pending_push_work=lambda: False))


def test_failure_prone_tiers_need_kvtier_connector(tmp_path: Path) -> None:
    extra = {"cpu_bytes_to_use": 1 << 20, "disk_path": str(tmp_path), "disk_bytes_to_use": 1 << 24}
    with pytest.raises(ValueError, match='"kv_connector": "KvtierConnector"'):
        KvtierOffloadingSpec(spec_config(extra))
    KvtierOffloadingSpec(spec_config({"cpu_bytes_to_use": 1 << 20}))  # CPU only: fine


def test_a_key_listed_twice_is_stored_once_and_settled_once(engines: list[Engine]) -> None:
    """Issue 17's bug class at the vLLM boundary: a repeated key never takes two slots,
    and a failed store of it frees its slot once (two live blocks never share one)."""
    engine = Engine({"cpu_bytes_to_use": 2 * BLOCK_BYTES})
    engines.append(engine)
    k1, k2, k3, k4 = keys_of(4)
    out = engine.manager.prepare_store([k1, k1], engine.ctx)
    assert out is not None and out.keys_to_store == [k1]
    (part,) = out.store_spec.parts
    assert part.spec.block_ids.tolist() == [0]
    engine.manager.complete_store([k1, k1], engine.ctx, success=False)
    slots = []
    for key in (k2, k3, k4):
        out = engine.manager.prepare_store([key], engine.ctx)
        assert out is not None
        (slot,) = out.store_spec.parts[0].spec.block_ids.tolist()
        slots.append(slot)
        engine.manager.complete_store([key], engine.ctx)
    assert sorted(slots[:2]) == [0, 1]  # both slots free again, each handed out once
    assert slots[2] == slots[0]  # k4 takes the slot of k2, the least recent; k3 keeps its own
    assert engine.hits([k3]) == 1 and engine.hits([k4]) == 1 and engine.hits([k2]) == 0


def test_the_redis_worker_sends_with_redis_store_threads(engines: list[Engine]) -> None:
    """`redis_store_threads`: that many threads send the Redis tier's stores (four by
    default); the CPU tier's worker keeps one."""
    url = "redis://127.0.0.1:9"  # never reached here: threads are made at start
    for extra, threads in (({}, 4), ({"redis_store_threads": 2}, 2)):
        engine = Engine({"cpu_bytes_to_use": 2 * BLOCK_BYTES, "redis_url": url} | extra)
        engines.append(engine)
        names = [t.name for t in engine.worker.workers["remote"]._threads]
        assert names.count("kvtier-redis-store") == threads
        assert names.count("kvtier-redis-load") == 1
        local = [t.name for t in engine.worker.workers["local"]._threads]
        assert local.count("kvtier-cpu-store") == 1
