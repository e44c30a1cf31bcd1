"""Transfer workers: byte-identical round trips, ordering, failures reported, never raised."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.remote.kv_store import LoadGuard
from kvtier.store.layout import KVLayout, LayoutMismatchError
from kvtier.store.memory import MemoryStore
from kvtier.store.protocol import BlockLoadError
from kvtier.transfer import device, handlers
from kvtier.transfer.device import DeviceKV, coalesce_runs, count_runs
from kvtier.transfer.handlers import HostSlotHandler, StagedHandler, slot_order
from kvtier.transfer.transfer_worker import TransferWorker
from tests.transfer.helpers import (
    CROSS_LAYER,
    LAYOUTS,
    PER_LAYER,
    DictStore,
    HashSpec,
    block_bytes,
    hashes,
    random_kv,
)

# Six jobs of four blocks: consecutive and scattered ids on both sides.
DEVICE_JOBS = [
    [0, 1, 2, 3],
    [7, 5, 6, 4],
    [8, 10, 9, 11],
    [12, 13, 20, 21],
    [30, 2, 17, 18],
    [25, 26, 27, 28],
]
SLOT_JOBS = [
    [0, 1, 2, 3],
    [4, 5, 6, 7],
    [15, 9, 8, 14],
    [10, 11, 12, 13],
    [16, 20, 18, 19],
    [22, 23, 21, 17],
]


def test_coalesce_runs_pairs_consecutive_ids_only() -> None:
    src = np.array([4, 5, 6, 9, 10, 3], dtype=np.int64)
    dst = np.array([0, 1, 3, 4, 5, 6], dtype=np.int64)
    assert coalesce_runs(src, dst) == [(4, 0, 2), (6, 3, 1), (9, 4, 2), (3, 6, 1)]
    assert coalesce_runs(src[:0], dst[:0]) == []
    assert count_runs(src, dst) == 4 and count_runs(src[:0], dst[:0]) == 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=["per_layer", "cross_layer"])
@pytest.mark.parametrize("medium", ["memory", "staged"])
@pytest.mark.parametrize("copies", ["numpy", "torch"])
def test_round_trip_is_byte_identical_under_concurrent_jobs(
    layout: KVLayout, medium: str, copies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if copies == "torch":  # big pieces and rows go through torch copies: make every one big
        monkeypatch.setattr(device, "TORCH_COPY_BYTES", 1)
        monkeypatch.setattr(device, "TORCH_ROW_BYTES", 1)
    kv = random_kv(layout, num_blocks=32, seed=1)
    expected = {
        slot: block_bytes(kv, dev)
        for d, s in zip(DEVICE_JOBS, SLOT_JOBS, strict=True)
        for dev, slot in zip(d, s, strict=True)
    }
    store = MemoryStore(layout, 24) if medium == "memory" else DictStore(layout)

    def spec(slots: Sequence[int]) -> LoadStoreSpec:
        return CPULoadStoreSpec(list(slots)) if medium == "memory" else hashes(*slots)

    with TransferWorker.for_store(kv, store, max_queued_jobs=8) as worker:
        for job_id, (dev, slots) in enumerate(zip(DEVICE_JOBS, SLOT_JOBS, strict=True)):
            assert worker.submit_store(job_id, dev, spec(slots))
        assert worker.wait(range(6))
        stored = worker.get_finished()
        for cache in kv.caches:
            cache.zero_()
        # Load every slot back into a different device block, again as concurrent jobs.
        targets = list(range(31, 7, -1))
        for job_id in range(6):
            slots = list(range(4 * job_id, 4 * job_id + 4))
            assert worker.submit_load(
                100 + job_id, spec(slots), targets[4 * job_id : 4 * job_id + 4]
            )
        assert worker.wait(range(100, 106))
        loaded = worker.get_finished()
    assert [r.job_id for r in stored] == list(range(6)) and all(r.ok for r in stored)
    assert [r.job_id for r in loaded] == list(range(100, 106)) and all(r.ok for r in loaded)
    assert {r.bytes for r in stored + loaded} == {4 * layout.bytes_per_block}
    for slot, device_block in enumerate(targets):
        assert block_bytes(kv, device_block) == expected[slot], f"slot {slot}"


def test_failed_job_is_reported_and_later_jobs_still_run() -> None:
    kv = random_kv(PER_LAYER, num_blocks=8, seed=2)
    store = DictStore(PER_LAYER)
    store.broken = set(hashes(2).block_hashes)
    with TransferWorker.for_store(kv, store) as worker:
        worker.submit_store(1, [0], hashes(1))
        worker.submit_store(2, [1], hashes(2))
        worker.submit_store(3, [2], hashes(3))
        worker.submit_load(4, hashes(9), [3])  # never stored: a miss, not an exception
        worker.wait([1, 2, 3, 4])
        results = {r.job_id: r for r in worker.get_finished()}
    assert [results[j].ok for j in (1, 2, 3, 4)] == [True, False, True, False]
    assert results[2].bytes == 0
    assert sorted(job for job, _ in worker.errors) == [2, 4]


class GatedStore(DictStore):
    """Blocks every write until `gate` is set, and says when a write has started."""

    def __init__(self, layout: KVLayout) -> None:
        super().__init__(layout)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        self.entered.set()
        self.gate.wait()
        super().write_blocks(spec, blocks)


def test_full_queue_rejects_and_results_keep_submission_order() -> None:
    kv = random_kv(PER_LAYER, num_blocks=8, seed=3)
    store = GatedStore(PER_LAYER)
    with TransferWorker.for_store(kv, store, max_queued_jobs=1) as worker:
        assert worker.submit_store(1, [0], hashes(1))
        store.entered.wait()
        assert worker.submit_store(2, [1], hashes(2))  # queued
        assert not worker.submit_store(3, [2], hashes(3))  # queue full: rejected
        assert worker.get_finished() == []  # job 3 waits for jobs 1 and 2
        assert not worker.wait([3], timeout=0)
        store.gate.set()
        assert worker.wait([1, 2, 3])
        results = worker.get_finished()
    assert [(r.job_id, r.ok) for r in results] == [(1, True), (2, True), (3, False)]


class GatedWrites(HostSlotHandler):
    """A memory handler with writes from its own slots (`submit_write`) that wait for
    `gate`; `written` lists the writes' specs in the order they ran."""

    def __init__(self, kv: DeviceKV, memory: MemoryStore) -> None:
        super().__init__(kv, memory)
        self.gate = threading.Event()
        self.written: list[str] = []

    def write(self, spec: str) -> int:
        self.gate.wait()
        self.written.append(spec)
        return 0


def test_writes_run_apart_and_hold_back_no_store() -> None:
    """A write from the medium's slots (the cascade's write-through) runs on a thread of
    its own: a store submitted after a write that hangs is done, and its result given,
    while the write still runs; writes keep their order among themselves."""
    kv = random_kv(PER_LAYER, num_blocks=8, seed=5)
    handler = GatedWrites(kv, MemoryStore(PER_LAYER, 8))
    with TransferWorker(handler, ordered=True) as worker:
        worker.submit_store(1, [0], CPULoadStoreSpec([0]))
        worker.submit_write(2, "first")  # type: ignore[arg-type]
        worker.submit_store(3, [1], CPULoadStoreSpec([1]))
        worker.submit_write(4, "second")  # type: ignore[arg-type]
        assert worker.wait([1, 3])
        assert [(r.job_id, r.ok) for r in worker.get_finished()] == [(1, True), (3, True)]
        assert not worker.wait([2], timeout=0)
        handler.gate.set()
        assert worker.wait([2, 4])
        assert [r.job_id for r in worker.get_finished()] == [2, 4]
    assert handler.written == ["first", "second"]
    plain = TransferWorker.for_store(kv, MemoryStore(PER_LAYER, 8))
    with plain, pytest.raises(TypeError, match="no writes from its own slots"):
        plain.submit_write(5, CPULoadStoreSpec([0]))


def test_a_close_with_a_deadline_leaves_a_hung_thread_running() -> None:
    """`close(timeout)`: a write that hangs does not keep the close (a shutdown) waiting
    past its deadline; the thread ends on its own once the medium goes on, and a later
    close says so."""
    kv = random_kv(PER_LAYER, num_blocks=8, seed=5)
    handler = GatedWrites(kv, MemoryStore(PER_LAYER, 8))
    worker = TransferWorker(handler, ordered=True)
    try:
        worker.submit_write(1, "hangs")  # type: ignore[arg-type]
        assert not worker.close(timeout=0.05)
        assert not worker.close(timeout=0.05)  # still hung
    finally:
        handler.gate.set()
    assert worker.close(timeout=60)  # the write ran, then its thread stopped
    assert [(r.job_id, r.ok) for r in worker.get_finished()] == [(1, True)]
    assert handler.written == ["hangs"]


def test_caller_mistakes_raise_and_change_nothing() -> None:
    kv = random_kv(PER_LAYER, num_blocks=4, seed=4)
    store = MemoryStore(PER_LAYER, 4)
    with TransferWorker.for_store(kv, store) as worker:
        with pytest.raises(ValueError, match="outside"):
            worker.submit_store(1, [0, 4], CPULoadStoreSpec([0, 1]))
        assert worker.submit_store(1, [0], CPULoadStoreSpec([0]))
        worker.wait([1])
        assert worker.submit_store(1, [1], CPULoadStoreSpec([1]))  # finished ids may be reused
        worker.wait([1])
        assert [r.job_id for r in worker.get_finished()] == [1, 1]
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit_load(2, CPULoadStoreSpec([0]), [0])


def test_a_store_spec_out_of_range_fails_the_job_not_the_caller() -> None:
    kv = random_kv(PER_LAYER, num_blocks=4, seed=5)
    with TransferWorker.for_store(kv, MemoryStore(PER_LAYER, 2)) as worker:
        worker.submit_store(1, [0], CPULoadStoreSpec([5]))
        worker.submit_store(2, [0], HashSpec([]))
        worker.wait([1, 2])
        assert [r.ok for r in worker.get_finished()] == [False, False]


def test_memory_checksums_catch_a_flipped_byte() -> None:
    kv = random_kv(PER_LAYER, num_blocks=4, seed=6)
    store = MemoryStore(PER_LAYER, 4, checksums=True)
    with TransferWorker.for_store(kv, store) as worker:
        worker.submit_store(1, [0, 1], CPULoadStoreSpec([0, 1]))
        worker.wait([1])
        store.array[1, 17] ^= 0xFF
        worker.submit_load(2, CPULoadStoreSpec([0]), [2])
        worker.submit_load(3, CPULoadStoreSpec([1]), [3])
        worker.wait([2, 3])
        assert [r.ok for r in worker.get_finished()] == [True, True, False]
    assert store.num_checksum_failures == 1
    assert block_bytes(kv, 2) == block_bytes(kv, 0)


def test_a_store_with_another_layout_is_refused() -> None:
    kv = random_kv(PER_LAYER, num_blocks=4, seed=7)
    other = dataclasses.replace(PER_LAYER, model_id="other-model")
    with pytest.raises(LayoutMismatchError):
        TransferWorker.for_store(kv, MemoryStore(other, 4))
    with pytest.raises(LayoutMismatchError):
        TransferWorker.for_store(kv, DictStore(other))


def test_a_gather_refuses_source_ids_out_of_range() -> None:
    src, dst = (
        [torch.arange(32, dtype=torch.uint8).view(4, 8)],
        [torch.zeros((4, 8), dtype=torch.uint8)],
    )
    with pytest.raises(IndexError, match="outside"):
        device.copy_blocks(src, np.array([3, 1, 7]), dst, np.array([0, 1, 2]))
    assert not dst[0].any()
    device.copy_blocks(src, np.array([3, 1, 2]), dst, np.array([0, 1, 2]))
    assert dst[0][:3].tolist() == src[0][[3, 1, 2]].tolist()


@pytest.mark.parametrize("layout", LAYOUTS, ids=["per_layer", "cross_layer"])
def test_planes_stack_per_layer_and_copy_like_single_segments(layout: KVLayout) -> None:
    kv = random_kv(layout, num_blocks=8, seed=8)
    host = MemoryStore(layout, 8)
    stacks = device.stack_planes(kv.segments, host.segments())
    # A layer's K and V planes share one tensor at one stride; the host planes are one buffer.
    seg = layout.segment_bytes
    expected = [(2, 8, seg)] * layout.num_layers if layout.per_layer else [(1, 8, seg)]
    assert [tuple(src.shape) for src, _ in stacks] == expected
    for src, dst in stacks:
        dst[:, 2:5].copy_(src[:, 1:4])
    for block in range(1, 4):
        assert b"".join(host.slot_parts([block + 1])[0]) == block_bytes(kv, block)
    apart = [torch.zeros((4, 8), dtype=torch.uint8) for _ in range(2)]  # separate tensors
    assert len(device.stack_planes(apart, [torch.zeros((4, 8), dtype=torch.uint8)] * 2)) == 2


@pytest.mark.parametrize("row_bytes", [3, 16])
def test_gathers_and_scatters_move_whole_rows(row_bytes: int) -> None:
    planes = [torch.randint(0, 255, (8, row_bytes), dtype=torch.uint8) for _ in range(2)]
    out = [torch.zeros((8, row_bytes), dtype=torch.uint8) for _ in range(2)]
    gather_src, gather_dst = np.array([5, 0, 7, 2]), np.array([1, 2, 3, 4])  # dst one run
    device.copy_blocks(planes, gather_src, out, gather_dst)
    scatter_src, scatter_dst = np.array([4, 5, 6]), np.array([7, 0, 5])  # src one run
    device.copy_blocks(planes, scatter_src, out, scatter_dst)
    for src, dst in zip(planes, out, strict=True):
        assert dst[[1, 2, 3, 4]].tolist() == src[[5, 0, 7, 2]].tolist()
        assert dst[[7, 0, 5]].tolist() == src[[4, 5, 6]].tolist()


@pytest.mark.parametrize("row_bytes", [16, 64 << 10])  # numpy pieces; torch `index_select`
@pytest.mark.parametrize("strided", ["src", "dst"])
def test_copies_between_halves_of_pages_move_the_right_rows(row_bytes: int, strided: str) -> None:
    """vLLM's CPU pages cut into K and V halves: strided planes, as a store's source or a
    load's destination; device ids descending (vLLM's free queue hands them out so)."""
    gen = torch.Generator().manual_seed(3)
    pages = torch.randint(0, 255, (12, 2 * row_bytes), dtype=torch.uint8, generator=gen)
    halves = [pages.view(12, 2, row_bytes)[:, i] for i in (0, 1)]
    flat = [torch.randint(0, 255, (12, row_bytes), dtype=torch.uint8, generator=gen) for _ in "kv"]
    src, dst = (halves, flat) if strided == "src" else (flat, halves)
    expected = [d.clone() for d in dst]
    pairs = [
        (np.arange(11, 3, -1), np.arange(0, 8)),  # a reversed source into one run
        (np.array([2, 9, 0, 5]), np.array([8, 9, 10, 11])),  # a shuffled source into one run
        (np.arange(0, 4), np.array([11, 6, 3, 7])),  # one source run, scattered
    ]
    for src_ids, dst_ids in pairs:
        device.copy_blocks(src, src_ids, dst, dst_ids)
        for s, e in zip(src, expected, strict=True):
            e[torch.from_numpy(dst_ids)] = s[torch.from_numpy(src_ids)]
        for d, e in zip(dst, expected, strict=True):
            assert torch.equal(d, e)


def _new_thread_torch_threads() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_threads_limiting_torch_at_once_leave_the_default_for_later_threads() -> None:
    """Copy helpers start together; each must not take another's lowered default for
    the process's (before the lock, 39 of 50 such rounds left new threads at one)."""
    before = _new_thread_torch_threads()
    try:
        for _ in range(20):
            barrier = threading.Barrier(8)

            def limit(barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                device.limit_torch_threads(1)

            threads = [threading.Thread(target=limit) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert _new_thread_torch_threads() == before
    finally:
        device._in_new_thread(torch._C.set_num_threads, before)


def test_a_worker_limits_torch_threads_in_its_own_threads_only() -> None:
    seen: list[int] = []
    before = torch.get_num_threads()

    def later() -> None:
        seen.append(torch.get_num_threads())

    class Probe:
        kv = random_kv(LAYOUTS[0], num_blocks=2, seed=1)

        def ready_event(self) -> None:
            return None

        def load(self, spec: object, device_ids: object, ready: object = None) -> int:
            seen.append(torch.get_num_threads())
            return 0

    worker = TransferWorker(Probe(), torch_threads=1)  # type: ignore[arg-type]
    worker.submit_load(1, object(), np.array([0]))  # type: ignore[arg-type]
    worker.wait([1])
    worker.close()
    thread = threading.Thread(target=later)
    thread.start()
    thread.join()
    assert seen == [1, before]  # the worker's copies; a thread started after it
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="torch_threads"):
        TransferWorker(Probe(), torch_threads=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["per_layer", "cross_layer"])
@pytest.mark.parametrize("copy_threads", [2, 3])
def test_copy_threads_share_a_job_and_move_the_same_bytes(
    layout: KVLayout, copy_threads: int
) -> None:
    kv = random_kv(layout, num_blocks=12, seed=4)
    expected = {i: block_bytes(kv, i) for i in range(12)}
    host = MemoryStore(layout, 12)
    with TransferWorker.for_store(kv, host, copy_threads=copy_threads) as worker:
        ids = np.array([11, 3, 7, 0, 5, 9])
        worker.submit_store(1, ids, CPULoadStoreSpec(list(range(6))))
        worker.wait([1])
        for seg in kv.segments:
            seg.zero_()
        worker.submit_load(2, CPULoadStoreSpec([5, 4, 3, 2, 1, 0]), np.arange(6))
        worker.wait([2])
        assert all(r.ok for r in worker.get_finished())
    assert [block_bytes(kv, i) for i in range(6)] == [expected[int(i)] for i in ids[::-1]]


def test_copy_threads_split_whole_layers() -> None:
    from kvtier.transfer.handlers import _shares

    assert _shares(48, 2) == [slice(0, 24), slice(24, 48)]
    assert _shares(6, 4) == [slice(0, 2), slice(2, 4), slice(4, 6)]  # three layers
    assert _shares(1, 2) == [slice(0, 1)]
    with pytest.raises(ValueError, match="copy_threads"):
        kv = random_kv(LAYOUTS[0], num_blocks=2, seed=1)
        TransferWorker.for_store(kv, MemoryStore(LAYOUTS[0], 2), copy_threads=0)


def test_a_load_given_up_at_its_deadline_never_reaches_the_engine() -> None:
    """A staged load whose guard was abandoned (its deadline passed, the engine recomputes
    the blocks) fails, and not one byte of it is copied into the engine's blocks."""
    kv = random_kv(PER_LAYER, num_blocks=4, seed=9)
    store = DictStore(PER_LAYER)
    with TransferWorker.for_store(kv, store) as worker:
        worker.submit_store(1, [0], hashes(1))
        worker.wait([1])
        before = block_bytes(kv, 3)
        given_up, kept = hashes(1), hashes(1)
        given_up.guard = LoadGuard()  # type: ignore[attr-defined]
        given_up.guard.abandon()  # type: ignore[attr-defined]
        kept.guard = LoadGuard()  # type: ignore[attr-defined]
        worker.submit_load(2, given_up, [3])
        worker.submit_load(3, kept, [2])
        worker.wait([2, 3])
        results = {r.job_id: r.ok for r in worker.get_finished()}
    assert results == {1: True, 2: False, 3: True}
    assert block_bytes(kv, 3) == before
    assert block_bytes(kv, 2) == block_bytes(kv, 0)
    assert any("given up" in error for _, error in worker.errors)


class GuardingStore(DictStore):
    """A medium that copies a load under its spec's guard itself, as the Redis tier's do."""

    copies_under_guard = True

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        guard = getattr(spec, "guard", None)
        assert guard is not None
        self.read_into = [bytes(b) == bytes(len(b)) for b in blocks]  # a fresh row is zeros
        with guard.copying("a test load"):
            super().read_blocks(spec, blocks)


def test_a_medium_that_copies_under_the_guard_loads_straight_into_the_engine() -> None:
    """No staging rows, and no second copy of every byte, where the medium itself keeps
    a given-up load's bytes out of the engine's blocks; a medium that does not (the
    disk) still reads into staging rows (test above)."""
    kv = random_kv(CROSS_LAYER, num_blocks=4, seed=9)
    store = GuardingStore(CROSS_LAYER)
    handler = StagedHandler(kv, store)
    handler.store(np.array([0]), hashes(1), None)
    before = block_bytes(kv, 3)
    given_up, kept = hashes(1), hashes(1)
    given_up.guard = LoadGuard()  # type: ignore[attr-defined]
    given_up.guard.abandon()  # type: ignore[attr-defined]
    kept.guard = LoadGuard()  # type: ignore[attr-defined]
    with pytest.raises(BlockLoadError, match="given up"):
        handler.load(given_up, np.array([3]))
    assert block_bytes(kv, 3) == before
    handler.load(kept, np.array([2]))
    assert block_bytes(kv, 2) == block_bytes(kv, 0)
    assert store.read_into == [False]  # the engine's block, not a fresh staging row
    assert handler.staging_bytes == 0


@pytest.mark.parametrize(
    ("queued", "taken"),
    [
        # the first load goes ahead of the stores and discards before it, if it may
        ("S D L+ S", "L+ S D S"),
        # a load that may not pass keeps its turn, and the loads keep their order
        ("S L- L+ S", "S L- L+ S"),
        ("L- S L+", "L- L+ S"),
        # the stop marker stays last
        ("S L+ X", "L+ S X"),
    ],
)
def test_the_ordered_queue_lets_a_load_that_depends_on_nothing_go_first(
    queued: str, taken: str
) -> None:
    from kvtier.transfer.transfer_worker import _STOP, _OrderedJobs

    direction = {"S": "store", "D": "discard", "L": "load"}
    jobs = _OrderedJobs(16, may_pass=lambda spec: spec.endswith("+"))
    for name in queued.split():
        if name == "X":
            jobs.put(_STOP)
            continue
        jobs.put_nowait((direction[name[0]], dataclasses.make_dataclass("J", ["spec"])(name)))
    out = []
    for _ in queued.split():
        item = jobs.get()
        out.append("X" if item is _STOP else item[1].spec)
    assert " ".join(out) == taken


@pytest.mark.parametrize(
    ("binding", "cores"),
    [
        ("0-3|4-7", set(range(8))),
        ("0,2|1,3", {0, 1, 2, 3}),
        ("5", {5}),
        ("auto", set()),
        ("nobind", set()),
        ("", set()),
        ("0-x", set()),
    ],
)
def test_the_cores_of_vllms_binding_are_read_from_its_setting(
    binding: str, cores: set[int]
) -> None:
    assert device._bound_cores(binding) == cores


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a process allowed on two cores or more",
)
def test_a_thread_started_on_a_bound_core_stores_on_the_other_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's CPU worker computes on cores of its own; a kvtier thread started by it
    inherits them, and must copy elsewhere where there is anywhere else."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    allowed = sorted(os.sched_getaffinity(0))
    compute = {allowed[0]}
    seen: dict[str, object] = {}

    def bound_worker() -> None:
        os.sched_setaffinity(0, compute)  # as vLLM binds its worker's thread
        seen["moved"] = device.leave_compute_cores()
        seen["cores"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=bound_worker)
    thread.start()
    thread.join()
    assert seen["moved"] is True
    assert seen["cores"] == set(range(os.cpu_count() or 1)) & set(allowed) - compute

    def unbound() -> None:  # a thread that may run anywhere stays so
        seen["moved"] = device.leave_compute_cores()

    if set(allowed) == set(range(os.cpu_count() or 1)):
        thread = threading.Thread(target=unbound)
        thread.start()
        thread.join()
        assert seen["moved"] is False


def test_store_threads_overlap_a_slow_mediums_stores_and_keep_their_order() -> None:
    """Several store threads (`store_threads`, for a medium whose stores wait on round
    trips): two stores run at once, each waiting for the other to begin (one thread
    would hang here), the later one finishes first and its result still comes second.
    An ordered worker, or a medium with discards, keeps one thread."""
    began = threading.Barrier(2, timeout=30)
    second_done = threading.Event()

    class RoundTrips:
        kv = random_kv(LAYOUTS[0], num_blocks=4, seed=1)

        def ready_event(self) -> None:
            return None

        def store(self, device_ids: object, spec: int, ready: object) -> int:
            began.wait()  # both in flight at once
            if spec == 1:
                assert second_done.wait(30)  # the first ends after the second
            else:
                second_done.set()
            return 0

        def load(self, spec: object, device_ids: object, ready: object = None) -> int:
            return 0

    with TransferWorker(RoundTrips(), store_threads=2) as worker:  # type: ignore[arg-type]
        assert worker.submit_store(1, [0], 1)  # type: ignore[arg-type]
        assert worker.submit_store(2, [1], 2)  # type: ignore[arg-type]
        assert worker.wait([1, 2])
        assert [(r.job_id, r.ok) for r in worker.get_finished()] == [(1, True), (2, True)]
    kv = random_kv(PER_LAYER, num_blocks=8, seed=5)
    for ordered in (True, False):
        handler = GatedWrites(kv, MemoryStore(PER_LAYER, 8))
        if not ordered:
            handler.discard = lambda hashes: None  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="store_threads=2; at least 1, and 1 for an"):
            TransferWorker(handler, ordered=ordered, store_threads=2)
    with pytest.raises(ValueError, match="store_threads=0"):
        TransferWorker(RoundTrips(), store_threads=0)  # type: ignore[arg-type]


def test_snapshots_take_the_rows_of_those_written_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot (a slow store's copy of its blocks, taken on the engine's thread) takes
    the rows of one of as many blocks already written out (new rows cost their pages'
    first writes), never more rows than its blocks (what the store queue counts); the
    pool keeps at most SNAPSHOT_POOL_COUNT snapshots, the oldest dropped first."""
    kv = random_kv(PER_LAYER, num_blocks=16, seed=3)
    store = DictStore(PER_LAYER)
    handler = StagedHandler(kv, store)

    def write(staging: Any, ids: list[int]) -> None:
        spec = hashes(*ids)
        spec.staged = staging  # type: ignore[attr-defined]
        handler.store(np.array(ids), spec, None)

    first = handler.snapshot(np.array([1, 2, 3]))
    held = handler.snapshot(np.array([9, 10, 11]))  # not written out yet: rows of its own
    assert held is not first and len(first.rows) == 3
    write(first, [1, 2, 3])
    again = handler.snapshot(np.array([4, 5, 6]))
    assert again is first  # the same rows, written over
    assert handler.snapshot(np.array([7, 8])) is not first  # two rows: new ones
    write(again, [4, 5, 6])
    write(held, [9, 10, 11])
    assert store.blocks == {
        hashes(i).block_hashes[0]: block_bytes(kv, i) for i in range(1, 12) if i not in (7, 8)
    }
    monkeypatch.setattr(handlers, "SNAPSHOT_POOL_COUNT", 1)
    last = handler.snapshot(np.array([12]))
    write(last, [12])  # the pool keeps it alone: the two of three rows are dropped
    assert handler.snapshot(np.array([13, 14, 15])) not in (first, held)
    assert handler.snapshot(np.array([13])) is last


def test_store_threads_take_turns_on_the_shared_staging_rows() -> None:
    """Stores that copy through the handler's one set of staging rows (a GPU's, or a
    CPU store that is no snapshot) run one at a time, however many store threads: two
    at once wrote each other's bytes into those rows. The first write waits (half a
    second at most) for a second to come in beside it; none does."""
    kv = random_kv(PER_LAYER, num_blocks=8, seed=7)

    class Overlapping(DictStore):
        inside = most = 0
        second = threading.Event()
        count = threading.Lock()

        def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
            with self.count:
                self.inside += 1
                self.most = max(self.most, self.inside)
                first = self.inside == 1
            if first:
                self.second.wait(0.5)
            else:
                self.second.set()
            super().write_blocks(spec, blocks)
            with self.count:
                self.inside -= 1

    store = Overlapping(PER_LAYER)
    with TransferWorker.for_store(kv, store, store_threads=2) as worker:
        assert worker.submit_store(1, [0, 1], hashes(0, 1))
        assert worker.submit_store(2, [2, 3], hashes(2, 3))
        assert worker.wait([1, 2])
        assert all(r.ok for r in worker.get_finished())
    assert store.most == 1
    assert store.blocks == {hashes(i).block_hashes[0]: block_bytes(kv, i) for i in range(4)}


def test_slot_order_places_each_row_segment_in_the_slots_or_says_it_cannot() -> None:
    """`slot_order`: where each segment of a view of the same memory in another order
    lies in the CPU slots' segments (a row written from a slot's runs); None for
    segments of other memory, which no slot holds."""
    kv = random_kv(PER_LAYER, num_blocks=4, seed=9)
    assert slot_order(kv, kv) == [(j, 0, int(seg.shape[1])) for j, seg in enumerate(kv.segments)]
    other = random_kv(PER_LAYER, num_blocks=4, seed=9)
    assert slot_order(kv, other) is None
