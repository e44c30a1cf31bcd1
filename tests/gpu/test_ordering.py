"""Ordering between the engine's compute stream and kvtier's copy streams.

Two rules keep bytes right on a GPU: a store's copy waits on the event recorded on
the compute stream when the job was submitted (the kernel that wrote its block runs
first), and a job is reported done only once its copy has completed (the engine reads
a loaded block, a tier reads a stored one, only after the bytes are there). On CUDA the
tests make both races real (a kernel still running ahead of the write; a copy stream
held back) and fail if either event is removed; on the CPU the same protocol is checked
with recording stand-ins for streams and events.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.transfer import device as device_mod
from kvtier.transfer import handlers
from tests.gpu.kit import LAYOUTS, Tier, block_bytes, make_kv, run_jobs, spin

# --- on CUDA: the races, made real ------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier_name", ["cpu", "disk"])
def test_a_store_reads_the_bytes_a_kernel_still_running_writes(
    cuda: torch.device, layout: str, tier_name: str, tmp_path: Path
) -> None:
    kv = make_kv(layout, 16, cuda, seed=1)
    tier = Tier(tier_name, kv, tmp_path, num_blocks=8)
    new = [
        torch.randint(0, 256, (4, seg.shape[1]), device=cuda).to(torch.uint8) for seg in kv.segments
    ]
    old = [block_bytes(kv, b) for b in range(4, 8)]
    torch.cuda.synchronize()
    try:
        spin(0.3)  # the engine's kernels, still running ...
        for seg, data in zip(kv.segments, new, strict=True):
            seg[4:8].copy_(data)  # ... ahead of the one that writes blocks 4-7
        run_jobs(tier.worker, [("store", 0, range(4, 8), tier.spec(range(4)))])
        torch.cuda.synchronize()
        for slot, block in enumerate(range(4, 8)):
            assert tier.stored_bytes(slot) == block_bytes(kv, block), f"slot {slot}: old bytes"
            assert tier.stored_bytes(slot) != old[slot]
    finally:
        tier.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier_name", ["cpu", "disk"])
def test_a_load_reported_done_has_landed(
    cuda: torch.device, layout: str, tier_name: str, tmp_path: Path
) -> None:
    kv = make_kv(layout, 16, cuda, seed=2)
    tier = Tier(tier_name, kv, tmp_path, num_blocks=8)
    try:
        run_jobs(tier.worker, [("store", 0, range(4), tier.spec(range(4)))])
        expected = [block_bytes(kv, b) for b in range(4)]
        load_stream = tier.worker.handler._streams.load  # hold the copy back, as a busy link

        with torch.cuda.stream(load_stream):
            spin(0.3)
        run_jobs(tier.worker, [("load", 1, range(8, 12), tier.spec(range(4)))])
        # read at once on the compute stream, which knows nothing of the load stream
        assert [block_bytes(kv, b) for b in range(8, 12)] == expected
    finally:
        tier.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier_name", ["cpu", "disk"])
def test_a_load_lands_after_the_engine_is_done_with_its_blocks(
    cuda: torch.device, layout: str, tier_name: str, tmp_path: Path
) -> None:
    """The engine may still have work queued on a block it hands to a load (zeroing it,
    the last reads of its previous request): the load must land after that work."""
    kv = make_kv(layout, 16, cuda, seed=4)
    tier = Tier(tier_name, kv, tmp_path, num_blocks=8)
    try:
        run_jobs(tier.worker, [("store", 0, range(4), tier.spec(range(4)))])
        expected = [block_bytes(kv, b) for b in range(4)]
        torch.cuda.synchronize()
        spin(0.3)  # the engine's kernels, still running ...
        for seg in kv.segments:
            seg[8:12].zero_()  # ... ahead of the zeroing of the blocks the load fills
        run_jobs(tier.worker, [("load", 1, range(8, 12), tier.spec(range(4)))])
        torch.cuda.synchronize()
        assert [block_bytes(kv, b) for b in range(8, 12)] == expected
    finally:
        tier.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loads_and_stores_run_on_both_streams_beside_a_kernel(
    cuda: torch.device, layout: str, tmp_path: Path
) -> None:
    kv = make_kv(layout, 64, cuda, seed=3)
    tier = Tier("cpu", kv, tmp_path, num_blocks=32)
    try:
        run_jobs(tier.worker, [("store", 0, range(16), tier.spec(range(16)))])
        expected = [block_bytes(kv, b) for b in range(16, 32)] + [
            block_bytes(kv, b) for b in range(16)
        ]
        torch.cuda.synchronize()
        jobs = [
            ("store", 1, range(16, 32), tier.spec(range(16, 32))),
            ("load", 2, range(40, 56), tier.spec(range(16))),
        ]
        for (
            kind,
            job_id,
            ids,
            spec,
        ) in jobs:  # submitted before the kernel: they need not wait for it
            assert (
                tier.worker.submit_store(job_id, ids, spec)
                if kind == "store"
                else tier.worker.submit_load(job_id, spec, ids)
            )
        spin(2.0)
        assert tier.worker.wait([1, 2], timeout=60)
        assert all(r.ok for r in tier.worker.get_finished())
        assert not torch.cuda.current_stream().query(), "the copies waited for the kernel"
        torch.cuda.synchronize()
        assert [tier.stored_bytes(s) for s in range(16, 32)] == expected[:16]
        assert [block_bytes(kv, b) for b in range(40, 56)] == expected[16:]
    finally:
        tier.close()


# --- on the CPU: the same protocol, with recording stand-ins ---------------


class _Event:
    def __init__(self, log: list[tuple[str, ...]]) -> None:
        self.log, self.name = log, f"event{len([e for e in log if e[0] == 'new event'])}"
        log.append(("new event", self.name))

    def record(self, stream: _Stream) -> None:
        self.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class _Stream:
    def __init__(self, log: list[tuple[str, ...]], name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait", self.name, event.name))


@pytest.fixture
def protocol(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Stand-ins for CUDA streams and events that log every call, in order."""
    log: list[tuple[str, ...]] = []
    streams = iter(["store stream", "load stream"])
    monkeypatch.setattr(device_mod, "cuda_event", lambda: _Event(log))
    monkeypatch.setattr(handlers, "cuda_event", lambda: _Event(log))
    monkeypatch.setattr(device_mod, "current_stream", lambda device: _Stream(log, "compute"))
    monkeypatch.setattr(handlers, "cuda_stream", lambda device: _Stream(log, next(streams)))

    @contextlib.contextmanager
    def on_stream(stream: _Stream) -> Iterator[None]:
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    monkeypatch.setattr(handlers, "on_stream", on_stream)
    real_copy = handlers.copy_blocks

    def copy(*args: Any, **kwargs: Any) -> int:
        log.append(("copy",))
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(handlers, "copy_blocks", copy)
    return log


@pytest.mark.parametrize("tier_name", ["cpu", "disk"])
def test_the_stream_protocol_on_the_cpu(
    protocol: list[tuple[str, ...]], tier_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's pages, taken as a CUDA device's: the disk goes through staging rows
    kv = make_kv("pages", 8, torch.device("cpu"), seed=4)
    monkeypatch.setattr(kv, "is_cuda", True)  # the CUDA code path, with the stand-ins
    tier = Tier(tier_name, kv, tmp_path, num_blocks=4)
    if tier_name == "disk":  # the tier's own I/O, to see that it comes after the copy
        for method in ("write_blocks", "read_blocks"):
            real = getattr(tier.store, method)
            monkeypatch.setattr(
                tier.store,
                method,
                lambda *a, _m=method, _r=real: (protocol.append((_m,)), _r(*a))[1],
            )
    try:
        run_jobs(tier.worker, [("store", 0, [1, 2], tier.spec([0, 1]))])
        store_log = list(protocol)
        protocol.clear()
        run_jobs(tier.worker, [("load", 1, [5, 6], tier.spec([0, 1]))])
        load_log = list(protocol)
    finally:
        tier.close()
    write = [("write_blocks",)] if tier_name == "disk" else []
    read = [("read_blocks",)] if tier_name == "disk" else []
    # the store: an event on the compute stream at submission; the copy waits on it,
    # and the job ends only once the copy's own event has completed (then the disk write)
    assert store_log == [
        ("new event", "event0"),
        ("record", "event0", "compute"),
        ("enter", "store stream"),
        ("wait", "store stream", "event0"),
        ("copy",),
        ("new event", "event1"),
        ("record", "event1", "store stream"),
        ("exit", "store stream"),
        ("synchronize", "event1"),
        *write,
    ]
    # the load: likewise ordered after the compute stream's work at submission (on its
    # destination blocks), and done only once its copy has completed
    assert load_log == [
        ("new event", "event0"),
        ("record", "event0", "compute"),
        *read,
        ("enter", "load stream"),
        ("wait", "load stream", "event0"),
        ("copy",),
        ("new event", "event1"),
        ("record", "event1", "load stream"),
        ("exit", "load stream"),
        ("synchronize", "event1"),
    ]
