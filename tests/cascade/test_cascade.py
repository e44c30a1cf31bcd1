"""The CPU -> disk cascade with real bytes: round trips, demotion order, corruption, restart."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from kvtier.offload.cascade_manager import CascadeLoadSpec, CascadeStoreSpec
from kvtier.store.diskformat import file_name
from kvtier.store.layout import KVLayout
from kvtier.types import BlockHash, int_block_hash
from tests.cascade.engine import Engine
from tests.transfer.helpers import LAYOUTS, PER_LAYER, block_bytes


def hs(*ids: int) -> list[BlockHash]:
    return [int_block_hash(i) for i in ids]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["per_layer", "cross_layer"])
@pytest.mark.parametrize("disk_writes", ["demote", "write_through", "write_through_split"])
def test_round_trip_through_both_tiers(layout: KVLayout, disk_writes: str, tmp_path: Path) -> None:
    split = disk_writes.endswith("_split")
    engine = Engine(
        layout, tmp_path, disk_writes=disk_writes.removesuffix("_split"), split_writes=split
    )
    try:
        for job in range(6):  # 12 blocks through a 4-block CPU tier, jobs in flight together
            engine.store(hs(2 * job, 2 * job + 1), [2 * job, 2 * job + 1])
        assert engine.finish() == {"ok": 6, "failed": 0}
        assert engine.cascade.lookup(hs(*range(12))) == 12
        targets: list[int] = []
        for job in range(3):
            hashes = hs(*range(4 * job, 4 * job + 4))
            targets += engine.load(hashes)
        assert engine.finish() == {"ok": 3, "failed": 0}
        for block, target in enumerate(targets):
            assert block_bytes(engine.kv, target) == engine.expected[int_block_hash(block)]
        events = list(engine.cascade.take_events())
        assert {e.medium for e in events} == {"CPU", "DISK"}
    finally:
        engine.close()


def test_demotion_moves_evicted_blocks_and_events_say_which_tier(tmp_path: Path) -> None:
    engine = Engine(PER_LAYER, tmp_path, cpu_blocks=2)
    try:
        engine.store(hs(1, 2), [1, 2])
        engine.finish()
        engine.cascade.touch(hs(1, 2))  # a request used the prefix: its head is most recent
        out = engine.cascade.prepare_store(hs(3))
        assert out is not None and out.block_hashes_evicted == []  # demoted, not lost
        spec = out.store_spec
        assert isinstance(spec, CascadeStoreSpec) and spec.demotion is not None
        assert spec.demotion.block_hashes == hs(2)  # the tail of the prefix goes first
        events = [(e.medium, e.removed, e.block_hashes) for e in engine.cascade.take_events()]
        assert events == [
            ("CPU", False, hs(1, 2)),
            ("CPU", True, hs(2)),
            ("DISK", False, hs(2)),
        ]
        assert engine.cascade.lookup(hs(1, 2, 3)) == 2  # 3 is in flight; 2 readable on disk
    finally:
        engine.close()


def test_a_load_submitted_before_the_demoting_store_reads_the_old_slot(tmp_path: Path) -> None:
    engine = Engine(PER_LAYER, tmp_path, cpu_blocks=2, promote=False)
    try:
        engine.store(hs(1, 2), [1, 2])
        engine.finish()
        engine.cascade.touch(hs(1, 2))
        out = engine.cascade.prepare_store(hs(3))  # evicts 2 into a demotion
        assert out is not None
        spec = engine.cascade.prepare_load(hs(2))
        assert isinstance(spec, CascadeLoadSpec) and spec.demoting  # not on disk yet
        engine.expected[int_block_hash(3)] = block_bytes(engine.kv, 3)
        engine._submit("load", hs(2), [40], spec)  # before the store that reuses 2's slot
        engine._submit("store", hs(3), [3], out.store_spec)
        assert engine.finish() == {"ok": 2, "failed": 0}
        assert block_bytes(engine.kv, 40) == engine.expected[int_block_hash(2)]
        target = engine.load(hs(2))[0]  # now from disk
        engine.finish()
        assert block_bytes(engine.kv, target) == engine.expected[int_block_hash(2)]
    finally:
        engine.close()


def test_disk_hits_are_promoted_back_into_cpu(tmp_path: Path) -> None:
    engine = Engine(PER_LAYER, tmp_path, cpu_blocks=2)
    try:
        engine.store(hs(1, 2), [1, 2])
        engine.finish()
        engine.store(hs(3, 4), [3, 4])  # demotes 1 and 2
        engine.finish()
        spec = engine.cascade.prepare_load(hs(1, 2))
        assert isinstance(spec, CascadeLoadSpec)
        assert spec.disk_positions == [0, 1] and spec.promotion_positions == [0, 1]
        assert spec.demotion is not None and sorted(spec.demotion.block_hashes) == hs(3, 4)
        engine._submit("load", hs(1, 2), [50, 51], spec)
        assert engine.finish() == {"ok": 1, "failed": 0}
        again = engine.cascade.prepare_load(hs(1, 2))
        assert isinstance(again, CascadeLoadSpec) and again.cpu_positions == [0, 1]
        engine._submit("load", hs(1, 2), [52, 53], again)
        engine.finish()
        assert block_bytes(engine.kv, 52) == engine.expected[int_block_hash(1)]
        assert block_bytes(engine.kv, 53) == engine.expected[int_block_hash(2)]
    finally:
        engine.close()


def test_a_corrupt_disk_block_fails_its_load_and_is_forgotten(tmp_path: Path) -> None:
    engine = Engine(PER_LAYER, tmp_path, cpu_blocks=2, promote=False)
    try:
        engine.store(hs(1, 2), [1, 2])
        engine.finish()
        engine.store(hs(3, 4), [3, 4])  # demotes 1 and 2
        engine.finish()
        path = engine.disk_store.directory / file_name(int_block_hash(2))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
        assert engine.cascade.lookup(hs(1, 2, 3, 4)) == 4
        engine.load(hs(1, 2))
        assert engine.finish() == {"ok": 0, "failed": 1}
        assert engine.disk_store.stats().checksum_failures == 1
        assert engine.cascade.lookup(hs(1, 2, 3, 4)) == 1  # 2 forgotten: the prefix stops
    finally:
        engine.close()


def test_restart_recovers_the_disk_tier(tmp_path: Path) -> None:
    engine = Engine(PER_LAYER, tmp_path, cpu_blocks=2, disk_writes="write_through")
    engine.store(hs(1, 2, 3), [1, 2, 3])
    engine.finish()
    engine.close()
    restarted = Engine(PER_LAYER, tmp_path, cpu_blocks=2)
    try:
        assert restarted.disk_store.stats().recovered == 3
        assert restarted.cascade.lookup(hs(1, 2, 3)) == 3
        targets = restarted.load(hs(1, 2, 3))
        assert restarted.finish() == {"ok": 1, "failed": 0}
        for block, target in zip((1, 2, 3), targets, strict=True):
            assert block_bytes(restarted.kv, target) == engine.expected[int_block_hash(block)]
    finally:
        restarted.close()


def test_failed_demotions_are_remembered_per_slot_so_the_record_stays_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(PER_LAYER, tmp_path, cpu_blocks=2, promote=False)

    def broken(*args: object) -> None:
        raise OSError("injected disk write failure")

    try:
        engine.store(hs(0, 1), [0, 1])
        engine.finish()
        monkeypatch.setattr(engine.disk_store, "write_parts", broken)
        for job in range(1, 12):  # every store demotes two blocks, and every demotion fails
            out = engine.cascade.prepare_store(hs(2 * job, 2 * job + 1))
            assert out is not None and isinstance(out.store_spec, CascadeStoreSpec)
            assert out.store_spec.demotion is not None
            # Prepared while the demotion is pending, run after the store reusing its slot.
            load = engine.cascade.prepare_load(hs(2 * job - 1))
            engine._submit(
                "store", hs(2 * job, 2 * job + 1), [2 * job, 2 * job + 1], out.store_spec
            )
            engine._submit("load", hs(2 * job - 1), [40], load)
            assert engine.finish() == {"ok": 1, "failed": 1}  # never the slot's new bytes
            assert len(engine.handler._failed_demotions) <= 2  # one per CPU slot, not per block
        monkeypatch.undo()
        engine.store(hs(30, 31), [30, 31])  # demotions that succeed clear their slots
        engine.finish()
        assert engine.handler._failed_demotions == {}
    finally:
        engine.close()


def test_discards_are_their_own_jobs_run_in_order_with_the_stores(tmp_path: Path) -> None:
    """The scheduler lets disk blocks go (evicted, failed); their files are deleted by a
    discard job, run in submission order with the stores (not dressed as a store)."""
    from kvtier.transfer.transfer_worker import TransferWorker

    engine = Engine(PER_LAYER, tmp_path, disk_writes="write_through")
    try:
        engine.store(hs(0, 1), [0, 1])
        assert engine.finish() == {"ok": 1, "failed": 0}
        directory = engine.disk_store.directory
        assert (directory / file_name(int_block_hash(0))).exists()
        engine.worker.submit_discard(100, hs(0))
        engine.store(hs(2), [2])
        engine.worker.wait([100])
        assert not (directory / file_name(int_block_hash(0))).exists()
        assert (directory / file_name(int_block_hash(1))).exists()
        results = engine.worker.get_finished()
        assert [r.job_id for r in results][:1] == [100] and results[0].ok
        with (
            TransferWorker.for_store(engine.kv, engine.memory) as memory_worker,
            pytest.raises(TypeError, match="HostSlotHandler holds no blocks to discard"),
        ):
            memory_worker.submit_discard(7, hs(1))
    finally:
        engine.close()


def test_a_load_of_ready_blocks_goes_ahead_of_the_stores_queued_before_it(tmp_path: Path) -> None:
    """While a write-through store is on the disk, another store and two loads queue
    behind it: both loads only read ready blocks (the disk block is served without a
    promotion: the CPU tier is full of pinned blocks), so both run ahead of the queued
    store, in their own order. Every byte is right after."""
    engine = Engine(PER_LAYER, tmp_path, cpu_blocks=3, disk_writes="write_through")
    try:
        engine.store(hs(1, 2, 3), [1, 2, 3])  # job 0
        assert engine.finish() == {"ok": 1, "failed": 0}
        ran: list[str] = []
        handler = engine.handler
        store, load = handler.store, handler.load

        def record_store(*args: Any) -> int:
            ran.append("store")
            return store(*args)

        def record_load(spec: Any, *args: Any) -> int:
            ran.append("cpu load" if spec.cpu_positions else "disk load")
            return load(spec, *args)

        handler.store, handler.load = record_store, record_load  # type: ignore[method-assign]
        writing, release = threading.Event(), threading.Event()

        def hang(kind: str) -> None:
            if kind == "write" and not release.is_set():
                writing.set()
                release.wait()

        engine.disk_store.io_hook = hang
        engine.store(hs(4), [4])  # job 1: evicts block 1 (on disk); its write hangs
        assert writing.wait(timeout=60)
        engine.store(hs(5), [5])  # job 2, queued: evicts block 2
        cpu_target = engine.load(hs(3))  # job 3: a CPU block, ready
        disk_target = engine.load(hs(1))  # job 4: from disk (no room to promote it)
        release.set()
        assert engine.finish() == {"ok": 4, "failed": 0}
        assert ran == ["store", "cpu load", "disk load", "store"]
        assert block_bytes(engine.kv, cpu_target[0]) == engine.expected[hs(3)[0]]
        assert block_bytes(engine.kv, disk_target[0]) == engine.expected[hs(1)[0]]
        assert engine.cascade.lookup(hs(1, 3, 4, 5)) == 4
    finally:
        engine.close()


def test_a_split_store_writes_its_blocks_as_they_were_when_submitted(tmp_path: Path) -> None:
    """A store's disk part cut away from its copy (as kvtier's vLLM worker runs it): the
    blocks the CPU tier takes are written from its slots, the ones it is too full for
    from host rows copied at submission; the engine overwrites its blocks right after
    (vLLM's flush waited for the copy alone), and the disk still gets the stored bytes."""
    engine = Engine(
        PER_LAYER, tmp_path, cpu_blocks=2, disk_writes="write_through", split_writes=True
    )
    try:
        engine.store(hs(1, 2), [1, 2])
        engine.store(hs(3, 4, 5), [3, 4, 5])  # 1 and 2 in flight: all of these go to disk
        assert engine._writes_only == {1}  # the second store: no copy, its rows are taken
        engine.worker.wait([0])  # vLLM's flush: the first store's copy into the CPU tier
        for cache in engine.kv.segments:
            cache[1:6] = 0  # the engine reuses its blocks
        assert engine.finish() == {"ok": 2, "failed": 0}
        stored = hs(1, 2, 3, 4, 5)
        assert engine.cascade.lookup(stored) == 5
        targets = engine.load(stored)
        assert engine.finish() == {"ok": 1, "failed": 0}
        for block_hash, target in zip(stored, targets, strict=True):
            assert block_bytes(engine.kv, target) == engine.expected[block_hash]
    finally:
        engine.close()


def test_a_split_demotion_holds_back_no_copy_and_no_load_reads_a_reused_slot(
    tmp_path: Path,
) -> None:
    """With `disk_writes: demote` and a full CPU tier every store evicts, and its
    demotion was the store's disk write, run in its copy: vLLM's flush of every store
    waited for the disk. Cut away (as kvtier's vLLM worker runs it), the copy job takes
    the evicted blocks out of their slots and goes on while their write hangs; a load of
    one of them meanwhile fails (recomputed: its slot holds the new block), and once the
    write is done it loads the demoted bytes from disk."""
    engine = Engine(PER_LAYER, tmp_path, cpu_blocks=2, disk_writes="demote", split_writes=True)
    gate = threading.Event()
    try:
        engine.store(hs(1, 2), [1, 2])
        assert engine.finish() == {"ok": 1, "failed": 0}
        engine.disk_store.io_hook = lambda kind: gate.wait() if kind == "write" else None
        engine.store(hs(3, 4), [3, 4])  # evicts 1 and 2: their demotion hangs
        store_job = max(engine._jobs)
        assert engine.worker.wait([store_job], timeout=60)  # the copy, not the disk
        assert engine.cascade.lookup(hs(1)) == 1  # readable on disk at once (cascade)
        engine.load(hs(1))
        load_job = max(engine._jobs)
        assert engine.worker.wait([load_job], timeout=60)
        gate.set()
        assert engine.finish() == {"ok": 1, "failed": 1}  # the load failed, not the store
        assert engine.cascade.lookup(hs(1, 2)) == 2
        targets = engine.load(hs(1, 2))
        assert engine.finish() == {"ok": 1, "failed": 0}
        for block_hash, target in zip(hs(1, 2), targets, strict=True):
            assert block_bytes(engine.kv, target) == engine.expected[block_hash]
    finally:
        gate.set()
        engine.close()


def test_a_load_whose_promotion_demotes_waits_for_no_disk_write(tmp_path: Path) -> None:
    """A disk hit is promoted into the CPU tier; with `disk_writes: demote` and the CPU
    tier full, the promotion's room is made by a demotion, which ran in the load: the
    request waited for a disk write. Staged and written apart (as kvtier's vLLM worker
    runs it), the load is done while the write hangs; the demoted block, meanwhile,
    fails its load (recomputed), and once written it loads its bytes from disk."""
    engine = Engine(PER_LAYER, tmp_path, cpu_blocks=2, disk_writes="demote", split_writes=True)
    gate = threading.Event()
    try:
        engine.store(hs(1, 2), [1, 2])
        assert engine.finish() == {"ok": 1, "failed": 0}
        engine.store(hs(3, 4), [3, 4])  # 1 and 2 demoted to disk
        assert engine.finish() == {"ok": 1, "failed": 0}
        engine.disk_store.io_hook = lambda kind: gate.wait() if kind == "write" else None
        (target,) = engine.load(hs(1))  # from disk, promoted: 3 (the least recent) demoted
        assert engine.worker.wait([max(engine._jobs)], timeout=60)  # not the disk's write
        assert block_bytes(engine.kv, target) == engine.expected[hs(1)[0]]
        assert engine.results([max(engine._jobs)]) == {max(engine._jobs): True}
        engine.cascade.complete_load(hs(1))
        engine._jobs.pop(max(engine._jobs))
        assert engine.cascade.lookup(hs(3)) == 1  # on disk (cascade), its write hanging
        engine.load(hs(3))
        assert engine.worker.wait([max(engine._jobs)], timeout=60)
        gate.set()
        assert engine.finish() == {"ok": 0, "failed": 1}
        engine.worker.wait(engine._detached)  # the demotion's write, done on its own
        (target,) = engine.load(hs(3))
        assert engine.finish() == {"ok": 1, "failed": 0}
        assert block_bytes(engine.kv, target) == engine.expected[hs(3)[0]]
    finally:
        gate.set()
        engine.close()
