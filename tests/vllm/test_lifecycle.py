"""A reset forgets and a restart remembers: kvtier's spec as vLLM drives it, no engine.

The scheduler side and the worker are built as `KvtierConnector` builds them (see
`test_offloading_spec.Engine`); vLLM's `reset_prefix_cache(reset_connector=True)`
reaches kvtier as `reset_cache()` on the scheduler side's manager.
"""

from __future__ import annotations

import threading
from pathlib import Path

from tests.remote.conftest import RedisServer, serve_redis
from tests.vllm.test_offloading_spec import BLOCK_BYTES, Engine, engines, hung_disk, keys_of

with_engines = engines  # the fixture, under this module's name too

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, Medium  # noqa: E402

from kvtier.vllm.offloading.job_specs import LOCAL  # noqa: E402


def block_files(path: Path) -> list[Path]:
    return sorted(path.glob("kvtier-*/*.kv"))


def test_a_reset_forgets_every_tier_and_reports_the_removals(
    engines: list[Engine], tmp_path: Path
) -> None:
    server_cm = serve_redis(tmp_path)
    server: RedisServer = next(server_cm)
    try:
        extra = {
            "cpu_bytes_to_use": 2 * BLOCK_BYTES,
            "disk_path": str(tmp_path / "disk"),
            "disk_bytes_to_use": 64 * (BLOCK_BYTES + 128),
            "disk_writes": "demote",
            "redis_url": server.url,
        }
        engine = Engine(extra, events=True)
        peer = Engine({"cpu_bytes_to_use": 2 * BLOCK_BYTES, "redis_url": server.url})
        engines += [engine, peer]
        keys = keys_of(5)
        engine.compute(list(range(5)), seed=1)
        for i, key in enumerate(keys):  # one by one: the CPU tier demotes to disk
            engine.store([key], [i])
        assert engine.hits(keys) == 5 and block_files(tmp_path / "disk")
        list(engine.manager.take_events())

        engine.manager.reset_cache()

        assert not block_files(tmp_path / "disk")  # deleted before reset_cache returned
        for key in keys:  # Redis included: its keys of before are never read again
            found = engine.manager.lookup(key, engine.ctx)
            if found is LookupResult.RETRY:
                assert engine.manager.remote.wait_lookups(timeout=30)
                found = engine.manager.lookup(key, engine.ctx)
            assert found is LookupResult.MISS
        removed = [e for e in engine.manager.take_events() if e.removed]
        assert {e.medium for e in removed} == {Medium.CPU, Medium.STORAGE}
        assert {k for e in removed for k in e.keys} == set(keys)

        # the tiers work after it: new bytes stored, loaded back exactly
        data = engine.compute([6, 7], seed=2)
        fresh = keys_of(2, start=50)
        engine.store(fresh, [6, 7])
        assert engine.hits(fresh) == 2

        def peer_finds(key: bytes) -> LookupResult:
            assert peer.manager.lookup(key, peer.ctx) is LookupResult.RETRY
            assert peer.manager.remote.wait_lookups(timeout=30)
            return peer.manager.lookup(key, peer.ctx)

        # written in the new epoch: a peer that did not reset misses it, and still
        # shares the old one; after its own first reset it shares the new one
        assert peer_finds(fresh[0]) is LookupResult.MISS
        assert peer_finds(keys[0]) is LookupResult.HIT
        peer.manager.reset_cache()
        assert peer_finds(fresh[0]) is LookupResult.HIT
        engine.compute(list(range(16)), seed=3)
        errors, report = engine.load(fresh, [0, 1])
        assert not errors and not report
        assert [engine.block_bytes(i) for i in (0, 1)] == [data[6], data[7]]
    finally:
        next(server_cm, None)


def shut_down(engine: Engine) -> None:
    """As vLLM's engine core does: the worker (executor) first, then the scheduler."""
    engine.worker.shutdown()
    engine.manager.shutdown()


def test_a_clean_shutdown_keeps_the_cpu_tier_on_disk_for_a_restart(
    engines: list[Engine], tmp_path: Path
) -> None:
    extra = {
        "cpu_bytes_to_use": 4 * BLOCK_BYTES,
        "disk_path": str(tmp_path),
        "disk_bytes_to_use": 64 * (BLOCK_BYTES + 128),
        "disk_writes": "demote",  # the CPU tier reaches disk only when it evicts
    }
    first = Engine(extra)
    keys = keys_of(6)
    data = first.compute(list(range(6)), seed=3)
    for i, key in enumerate(keys):  # the first two are demoted, the last four stay in CPU
        first.store([key], [i])
    assert len(block_files(tmp_path)) == 2
    shut_down(first)
    assert len(block_files(tmp_path)) == 6  # the CPU tier's four were flushed

    second = Engine(extra)
    assert second.hits(keys) == 6
    errors, report = second.load(keys, list(range(10, 16)))
    assert not errors and not report
    assert [second.block_bytes(i) for i in range(10, 16)] == list(data.values())

    # a reset, then a shutdown before any job: nothing of before the reset survives
    second.manager.reset_cache()
    shut_down(second)
    assert not block_files(tmp_path)
    third = Engine(extra)
    engines.append(third)
    assert third.hits(keys) == 0


def test_a_reset_voids_the_writes_of_before_it_not_begun(
    engines: list[Engine], tmp_path: Path
) -> None:
    """A slow disk's queue of writes at a reset: the writes of before the reset that the
    writer has not begun are void, written by no one (a disk 20 ms a block file slow with
    a full queue would otherwise delay the new epoch's writes for seconds). Counted by the
    disk's block-file writes: the one in progress (two blocks) and the job after the
    reset (one), not the two queued; only the new block is left on disk."""
    engine, hung = hung_disk(engines, tmp_path / "disk", cpu_blocks=16, disk_blocks=64)
    writes: list[str] = []
    writing = threading.Event()

    def slow(kind: str) -> None:
        if kind == "write":
            writes.append(kind)
            writing.set()
            hung.wait()

    assert engine.worker.disk is not None
    engine.worker.disk.io_hook = slow
    try:
        engine.compute([0, 1, 2, 3, 4, 5, 6], seed=6)
        for job, start, ids in ((90, 70, [0, 1]), (92, 72, [2, 3]), (93, 74, [4, 5])):
            out = engine.manager.prepare_store(keys_of(2, start=start), engine.ctx)
            assert out is not None
            engine.worker.submit_store(job, GPULoadStoreSpec(ids, [2], [0]), out.store_spec)
            engine.worker.wait({job})  # vLLM's flush: the copy only
        assert writing.wait(60)  # job 90's write has begun; 92's and 93's are queued
        engine.manager.reset_cache()
        after = keys_of(1, start=80)
        out = engine.manager.prepare_store(after, engine.ctx)
        assert out is not None and out.store_spec.epoch == 1
        threading.Timer(0.2, hung.set).start()
        engine.worker.submit_store(91, GPULoadStoreSpec([6], [1], [0]), out.store_spec)
        engine.worker.wait_finished({90, 91, 92, 93})
        assert {r.job_id for r in engine.worker.get_finished()} == {90, 91, 92, 93}
        assert not engine.worker.take_report().failed_stores  # void, not failed
        assert len(writes) == 3
        engine.manager.complete_store(out.keys_to_store, engine.ctx)
        files = {p.stem for p in block_files(tmp_path / "disk")}
        assert [after[0][:-4].hex() in name for name in files] == [True], files
    finally:  # a failure above must not leave the disk hung for the teardown
        hung.set()


def test_a_flush_writes_only_what_the_cpu_tier_holds_after_a_reset(
    engines: list[Engine], tmp_path: Path
) -> None:
    extra = {
        "cpu_bytes_to_use": 4 * BLOCK_BYTES,
        "disk_path": str(tmp_path),
        "disk_bytes_to_use": 64 * (BLOCK_BYTES + 128),
        "disk_writes": "demote",
    }
    engine = Engine(extra)
    old, new = keys_of(3), keys_of(1, start=10)
    engine.compute([0, 1, 2, 3], seed=4)
    engine.store(old, [0, 1, 2])
    engine.manager.reset_cache()
    engine.store(new, [3])  # the job of the new epoch: the worker forgets the old slots
    assert engine.worker.flush_to_disk() == 1
    shut_down(engine)
    restarted = Engine(extra)
    engines.append(restarted)
    assert restarted.hits(new) == 1 and restarted.hits(old) == 0


def test_no_disk_write_of_before_a_reset_outlives_it(engines: list[Engine], tmp_path: Path) -> None:
    """A store's write-through runs apart from its copy, and vLLM drops the jobs of
    before a reset without waiting for their writes. The first job after the reset
    deletes their blocks (its discards), but a write still in progress then writes its
    block after them: a block of before the reset for a restart to serve (after a weight
    update, the same hash with other bytes). It deletes what it wrote once it ends. The
    disk is held until a timer lets it go, after the next job is submitted, so the
    discards run first."""
    engine, hung = hung_disk(engines, tmp_path / "disk", cpu_blocks=8, disk_blocks=64)
    try:
        before = keys_of(2, start=70)
        engine.compute([0, 1], seed=4)
        out = engine.manager.prepare_store(before, engine.ctx)
        assert out is not None
        engine.worker.submit_store(90, GPULoadStoreSpec([0, 1], [2], [0]), out.store_spec)
        engine.worker.wait({90})  # vLLM's flush at the reset: the copy only

        engine.manager.reset_cache()  # job 90 is dropped, never completed here

        after = keys_of(1, start=80)
        engine.compute([2], seed=5)
        out = engine.manager.prepare_store(after, engine.ctx)
        assert out is not None and out.store_spec.epoch == 1
        threading.Timer(0.2, hung.set).start()
        engine.worker.submit_store(91, GPULoadStoreSpec([2], [1], [0]), out.store_spec)
        engine.worker.wait_finished({90, 91})
        assert {r.job_id for r in engine.worker.get_finished()} == {90, 91}
        engine.manager.complete_store(out.keys_to_store, engine.ctx)
        files = {p.stem for p in block_files(tmp_path / "disk")}
        assert not any(key[:-4].hex() in name for key in before for name in files), files
        assert any(after[0][:-4].hex() in name for name in files), files
    finally:  # a failure above must not leave the disk hung for the teardown
        hung.set()


def reset_mid_write(
    engine: Engine, hung: threading.Event, keys: list[bytes], device_ids: list[int], job: int
) -> None:
    """Store `keys` from `device_ids` as `job` with the disk's writes held until `hung` is
    set; once its write has begun, a reset (vLLM drops the job, never completed here)."""
    writing = threading.Event()

    def slow(kind: str) -> None:
        if kind == "write":
            writing.set()
            hung.wait()

    assert engine.worker.disk is not None
    engine.worker.disk.io_hook = slow
    out = engine.manager.prepare_store(keys, engine.ctx)
    assert out is not None
    gpu = GPULoadStoreSpec(device_ids, [len(device_ids)], [0])
    engine.worker.submit_store(job, gpu, out.store_spec)
    engine.worker.wait({job})  # vLLM's flush at the reset: the copy only
    assert writing.wait(60)  # the write has begun, and hangs
    engine.manager.reset_cache()


def test_a_reset_behind_a_disk_that_hangs_goes_on_without_it(
    engines: list[Engine], tmp_path: Path
) -> None:
    """A disk hangs in the middle of a write of before a reset. The first job after the
    reset used to wait for that write, and vLLM's step with it, for as long as the disk
    hung. Now it goes on: its own write queues behind on the writer thread, and the late
    write deletes what it wrote once it ends (a block of before the reset, whose discard
    came while it was being written), before the new block is written."""
    engine, hung = hung_disk(engines, tmp_path / "disk", cpu_blocks=16, disk_blocks=64)
    try:
        data = engine.compute([0, 1, 2, 3], seed=7)
        before, after = keys_of(2, start=84), keys_of(2, start=86)
        reset_mid_write(engine, hung, before, [0, 1], 95)
        out = engine.manager.prepare_store(after, engine.ctx)
        assert out is not None and out.store_spec.epoch == 1
        watchdog = threading.Timer(120, hung.set)  # (a job that waited would hang)
        watchdog.start()
        engine.worker.submit_store(96, GPULoadStoreSpec([2, 3], [2], [0]), out.store_spec)
        engine.worker.wait({96})  # vLLM's flush: the copy
        assert not hung.is_set(), "the first job after the reset waited for the disk"
        engine.manager.apply_worker_report(engine.worker.take_report())
        assert engine.hits(after) == 2  # copied: served from the CPU tier meanwhile
        errors, _ = engine.load(after, [10, 11])
        assert not errors and [engine.block_bytes(i) for i in (10, 11)] == [data[2], data[3]]

        hung.set()
        watchdog.cancel()
        engine.worker.wait_finished({95, 96})
        assert {r.job_id for r in engine.worker.get_finished()} >= {96}
        assert not engine.worker.take_report()  # nothing failed, nothing shed
        engine.manager.complete_store(out.keys_to_store, engine.ctx)
        files = {p.stem.split(".")[0] for p in block_files(tmp_path / "disk")}
        assert files == {k[:-4].hex() for k in after}  # the late block deleted itself
    finally:  # a failure above must not leave the disk hung for the teardown
        hung.set()


def test_after_a_reset_a_copy_job_that_writes_the_disk_is_shed_until_the_disk_answers(
    engines: list[Engine], tmp_path: Path
) -> None:
    """On a GPU the blocks a CPU tier too full to take them sends straight to disk are
    written in the store's copy job, not on the writer thread (`writes_disk_in_job`;
    played here on the CPU device). Beside a write of before a reset that still hangs,
    such a store could have its block (the same hash, other bytes after a weight
    update) overwritten by it: it is shed, counted, never failed, until the disk answers;
    then stores reach the disk again."""
    engine, hung = hung_disk(engines, tmp_path / "disk", cpu_blocks=2, disk_blocks=64)
    engine.worker._snapshots = False  # as on a GPU: disk writes from the device in the job
    try:
        data = engine.compute([0, 1, 2, 3, 4, 5], seed=8)
        before, after = keys_of(2, start=88), keys_of(4, start=90)
        reset_mid_write(engine, hung, before, [0, 1], 97)  # (its write-through hangs)
        out = engine.manager.prepare_store(after, engine.ctx)  # 2 to CPU, 2 to disk only
        assert out is not None and out.store_spec.epoch == 1
        watchdog = threading.Timer(120, hung.set)  # (a copy job that wrote would hang)
        watchdog.start()
        engine.worker.submit_store(98, GPULoadStoreSpec([2, 3, 4, 5], [4], [0]), out.store_spec)
        ok, report = engine.run(98)
        assert not hung.is_set(), "the store wrote the disk beside the hung write"
        assert ok and report.shed_stores == {LOCAL: [k[:-4] for k in after]}
        engine.manager.complete_store(out.keys_to_store, engine.ctx)
        assert engine.hits(after) == 0

        hung.set()
        watchdog.cancel()
        engine.worker.wait_finished({97})
        assert engine.store(after, [2, 3, 4, 5]) == after  # the disk answers: stored
        assert engine.hits(after) == 4
        errors, _ = engine.load(after, [10, 11, 12, 13])
        assert not errors
        assert [engine.block_bytes(i) for i in (10, 11, 12, 13)] == [data[i] for i in (2, 3, 4, 5)]
    finally:
        hung.set()
