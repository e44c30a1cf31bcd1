"""Data-plane bandwidth: memory and disk tiers against plain copies of the same bytes.

1. Memory tier: device blocks (CPU tensors here) -> host slots and back, through a
   `TransferWorker` (jobs of `JOB_BYTES`: 64 blocks of 256 KiB, 8 of 2 MiB), at 256 KiB
   and 2 MiB blocks, both engine layouts, device block ids consecutive or shuffled.
   Baseline (`*_ratio`, the target's: >= 80%), same run: plain copies of the same bytes
   between the same places, job by job and segment by segment, made by torch and numpy
   alternately: one contiguous copy per run of consecutive blocks, or for shuffled ids
   a torch `index_select` into the job's slots on a store and a numpy fancy-index
   assignment on a load (the faster library for each: numpy's gathers run at 60-80%
   of `index_select` here, torch's uint8 scatters at about a quarter of numpy's).
   Also reported: `*_ratio_vs_one_contiguous_copy`, against one torch or numpy copy of
   as many bytes between two flat buffers. The engine's per-layer layout cuts a job
   into one 16-32 KiB piece per block and segment, and with shuffled ids those pieces
   lie in random order; any copy of them runs at about 0.8 of one contiguous copy on
   this machine (no streaming stores, a cold prefetcher per piece), so that column
   measures the layout as much as the tier.
2. Disk tier: the same through a `DiskStore` (file per block, fsync, rename,
   directory fsync, xxh3 at store and load; a job's blocks spread over the store's 2
   I/O threads). Baseline (`*_ratio`, the target's: >= 70%), same run: plain sequential
   writes of the same bytes, one file per block, each fdatasync'ed, one directory
   fsync per job of files (the same durability), then plain sequential reads of them
   into distinct rows of one buffer (as a load lands in distinct cache blocks). Also
   reported: the same plain I/O on as many threads as the store has
   (`*_ratio_vs_plain_io_on_2_threads`), and for the per-layer layout plain `readv`s of
   the same files straight into the engine's scattered segments.

Each side runs as many times as its baseline, alternating with it (14 pairs for the
memory rows, 8 for disk stores, 16 for disk loads; which of the two goes first
alternates too: the VM's disk writes fast in bursts, then throttles). Reported:
the best bandwidth of each side, and `*_ratio`, the median over the alternating pairs
of baseline time / our time (the machine is shared: a pair sees about the same load,
while two bests may come from different moments). `*_best_ratio` is bests' ratio.

    .venv/bin/python -m benchmarks.bench_store [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import write_result
from kvtier.offload.disk_manager import DiskLoadStoreSpec
from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.store.disk_store import DiskStore
from kvtier.store.layout import KVLayout
from kvtier.store.memory import MemoryStore
from kvtier.transfer.device import DeviceKV, allocate_kv_caches
from kvtier.transfer.transfer_worker import TransferWorker
from kvtier.types import int_block_hash

JOB_BYTES = 16 << 20  # a job: one request's blocks, e.g. 64 blocks of 256 KiB, 8 of 2 MiB
LAYOUTS = {  # fp16, 8 KV heads of 128: 256 KiB and 2 MiB blocks
    "256KiB": KVLayout(num_layers=8, num_kv_heads=8, head_size=128, block_size=8),
    "2MiB": KVLayout(num_layers=32, num_kv_heads=8, head_size=128, block_size=16),
}


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def compare(
    ours: Callable[[], object], baseline: Callable[[], object], repeats: int
) -> tuple[float, float, float]:
    """Best seconds of each, and the median of the paired ratios (baseline / ours).

    Runs alternate, so each pair saw about the same machine load; the median of the
    pairs is steadier than a ratio of two bests taken at different moments."""
    timings = []
    for pair in range(repeats):
        if pair % 2:  # the baseline first in every other pair
            base = best_seconds(baseline, 1)
            mine = best_seconds(ours, 1)
        else:
            mine = best_seconds(ours, 1)
            base = best_seconds(baseline, 1)
        timings.append((mine, base))
    paired = statistics.median(base / mine for mine, base in timings)
    return min(t[0] for t in timings), min(t[1] for t in timings), paired


def filled_kv(layout: KVLayout, num_blocks: int) -> DeviceKV:
    generator = torch.Generator().manual_seed(0)
    caches = allocate_kv_caches(layout, num_blocks)
    for cache in caches:
        cache.view(torch.int16).random_(generator=generator)
    return DeviceKV(layout, caches)


def job_blocks(layout: KVLayout) -> int:
    return max(1, JOB_BYTES // layout.bytes_per_block)


def run_jobs(worker: TransferWorker, direction: str, ids: np.ndarray, specs: list[Any]) -> None:
    size = len(ids) // len(specs)
    for job, spec in enumerate(specs):
        device = ids[job * size : (job + 1) * size]
        if direction == "store":
            worker.submit_store(job, device, spec)
        else:
            worker.submit_load(job, spec, device)
    worker.wait(range(len(specs)))
    results = worker.get_finished()
    if not all(r.ok for r in results):
        raise RuntimeError(f"{direction} jobs failed: {worker.errors}")


class BaselineCopy:
    """A plain torch copy and a numpy copy of `total` filled bytes, alternately."""

    def __init__(self, total: int) -> None:
        self.src = torch.empty(total, dtype=torch.uint8).random_()
        self.dst = torch.empty_like(self.src).fill_(1)
        self.src_np, self.dst_np = self.src.numpy(), self.dst.numpy()
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls % 2:
            self.dst.copy_(self.src)
        else:
            np.copyto(self.dst_np, self.src_np)


class PlainSameBytes:
    """The memory target's baseline: plain copies of the same bytes between the same
    places, job by job and segment by segment (the device rows of a job to its
    consecutive slots on a store, back on a load). A run of consecutive device rows is
    one contiguous copy, by torch and numpy alternately; shuffled rows take the faster
    library's: a torch `index_select` on a store, a numpy fancy-index assignment on a
    load. The host side is a clone of the tier's buffer (same shape), so neither
    side's writes warm the other's cache."""

    def __init__(
        self, kv: DeviceKV, host: MemoryStore, ids: np.ndarray, per_job: int, direction: str
    ) -> None:
        self.device = list(kv.segments)
        self.host = [seg.clone() for seg in host.segments()]
        self.device_np = [seg.numpy() for seg in self.device]
        self.host_np = [seg.numpy() for seg in self.host]
        self.jobs = []
        for start in range(0, len(ids), per_job):
            rows = np.ascontiguousarray(ids[start : start + per_job])
            consecutive = bool(np.all(np.diff(rows) == 1))
            self.jobs.append((start, rows, torch.from_numpy(rows), consecutive))
        self.store = direction == "store"
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        use_torch = bool(self.calls % 2)
        for start, rows, index, consecutive in self.jobs:
            end = start + len(rows)
            if consecutive:
                first, last = int(rows[0]), int(rows[-1]) + 1
                self._runs(start, end, first, last, use_torch)
            elif self.store:  # numpy's gathers (np.take, fancy index) run at 60-80% of it
                for device, host in zip(self.device, self.host, strict=True):
                    torch.index_select(device, 0, index, out=host[start:end])
            else:
                for device_np, host_np in zip(self.device_np, self.host_np, strict=True):
                    device_np[rows] = host_np[start:end]

    def _runs(self, start: int, end: int, first: int, last: int, use_torch: bool) -> None:
        """One contiguous copy per segment between device rows [first, last) and slots
        [start, end), in this job's direction."""
        for k in range(len(self.device)):
            if use_torch:
                device, host = self.device[k][first:last], self.host[k][start:end]
                (host if self.store else device).copy_(device if self.store else host)
            else:
                device_np, host_np = self.device_np[k][first:last], self.host_np[k][start:end]
                if self.store:
                    np.copyto(host_np, device_np)
                else:
                    np.copyto(device_np, host_np)


def bench_memory(quick: bool) -> list[dict[str, Any]]:
    rows = []
    total = (64 if quick else 256) << 20
    repeats = 3 if quick else 7
    for size, base_layout in LAYOUTS.items():
        num_blocks = total // base_layout.bytes_per_block
        per_job = job_blocks(base_layout)
        contiguous = BaselineCopy(total)
        for per_layer in (True, False):
            layout = dataclasses.replace(base_layout, per_layer=per_layer)
            kv = filled_kv(layout, num_blocks)
            host = MemoryStore(layout, num_blocks)
            slots = np.arange(num_blocks, dtype=np.int64)
            specs = [
                CPULoadStoreSpec(slots[i : i + per_job]) for i in range(0, num_blocks, per_job)
            ]
            for order in ("consecutive", "shuffled"):
                ids = (
                    slots
                    if order == "consecutive"
                    else np.random.default_rng(1).permutation(num_blocks)
                )
                with TransferWorker.for_store(kv, host) as worker:
                    row: dict[str, Any] = {
                        "block": size,
                        "layout": "per_layer" if per_layer else "cross_layer",
                        "device_ids": order,
                    }
                    for direction in ("store", "load"):
                        job = functools.partial(run_jobs, worker, direction, ids, specs)
                        plain = PlainSameBytes(kv, host, ids, per_job, direction)
                        ours, base, paired = compare(job, plain, 2 * repeats)
                        del plain
                        row[f"{direction}_GBps"] = round(total / ours / 1e9, 2)
                        row[f"{direction}_baseline_GBps"] = round(total / base / 1e9, 2)
                        row[f"{direction}_best_ratio"] = round(base / ours, 3)
                        row[f"{direction}_ratio"] = round(paired, 3)
                        _, _, vs_one = compare(job, contiguous, 2 * repeats)
                        row[f"{direction}_ratio_vs_one_contiguous_copy"] = round(vs_one, 3)
                rows.append(row)
                print(_line("memory", row))
            del kv, host
    return rows


def settle(*runs: Callable[[], object]) -> None:
    """Before timing reads: flush what the stores left for writeback (its kernel
    threads would otherwise take a core from two-thread loads for a while, and not
    from a one-thread baseline), and run each side once untimed."""
    os.sync()
    for run in runs:
        run()


class PlainFiles:
    """Plain durable writes (file per block, fdatasync, a directory fsync per job of
    files) and plain reads of the same bytes: the disk tier's baseline."""

    def __init__(self, directory: Path, blocks: list[bytes], per_job: int) -> None:
        directory.mkdir()
        self.per_job = per_job
        self.directory = directory
        self.blocks = blocks
        self.names = [directory / f"plain-{i}" for i in range(len(blocks))]
        size = len(blocks[0])
        destination = memoryview(bytearray(size * len(blocks)))  # distinct rows, like a cache
        self.rows = [destination[i * size : (i + 1) * size] for i in range(len(blocks))]

    def write(self) -> None:
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        for (files,) in self._job_shards(1):
            self._write_files(files)
            os.fsync(dir_fd)
        os.close(dir_fd)

    def read(self) -> None:
        self._read_files(range(len(self.names)))

    def write_on(self, pool: ThreadPoolExecutor, threads: int) -> None:
        """`write` with each job's files split over `threads` threads."""
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        for shards in self._job_shards(threads):
            list(pool.map(self._write_files, shards))
            os.fsync(dir_fd)
        os.close(dir_fd)

    def read_on(self, pool: ThreadPoolExecutor, threads: int) -> None:
        """`read` with each job's files split over `threads` threads."""
        for shards in self._job_shards(threads):
            list(pool.map(self._read_files, shards))

    def _job_shards(self, threads: int) -> list[list[range]]:
        jobs = []
        for start in range(0, len(self.names), self.per_job):
            end = min(start + self.per_job, len(self.names))
            cuts = [start + (end - start) * i // threads for i in range(threads + 1)]
            jobs.append([range(cuts[i], cuts[i + 1]) for i in range(threads)])
        return jobs

    def _write_files(self, indices: range) -> None:
        for i in indices:
            fd = os.open(self.names[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, self.blocks[i])
            os.fdatasync(fd)
            os.close(fd)

    def _read_files(self, indices: range) -> None:
        for i in indices:
            with open(self.names[i], "rb", buffering=0) as file:
                file.readinto(self.rows[i])

    def read_into(self, kv: DeviceKV) -> None:
        """Plain reads straight into the engine's layout (one readv per block)."""
        arrays = [seg.numpy() for seg in kv.segments]
        for i, name in enumerate(self.names):
            fd = os.open(name, os.O_RDONLY)
            os.readv(fd, [memoryview(a[i]) for a in arrays])
            os.close(fd)


def bench_disk(quick: bool, root: Path) -> list[dict[str, Any]]:
    rows = []
    total = (32 if quick else 128) << 20
    repeats = 2 if quick else 8  # pairs of stores; loads (a 30 ms run) get twice as many
    for size, base_layout in LAYOUTS.items():
        num_blocks = total // base_layout.bytes_per_block
        hashes = [int_block_hash(i) for i in range(num_blocks)]
        per_job = job_blocks(base_layout)
        specs = [
            DiskLoadStoreSpec(hashes[i : i + per_job], list(range(i, i + per_job)))
            for i in range(0, num_blocks, per_job)
        ]
        for per_layer in (True, False):
            layout = dataclasses.replace(base_layout, per_layer=per_layer)
            kv = filled_kv(layout, num_blocks)
            directory = root / f"{size}-{per_layer}"
            store = DiskStore(directory, layout, DiskStore.capacity_for(layout, num_blocks))
            ids = np.arange(num_blocks, dtype=np.int64)
            row: dict[str, Any] = {
                "block": size,
                "layout": "per_layer" if per_layer else "cross_layer",
            }
            blocks = [os.urandom(layout.bytes_per_block) for _ in range(num_blocks)]
            plain = PlainFiles(root / f"plain-{size}-{per_layer}", blocks, per_job)
            with TransferWorker.for_store(kv, store) as worker:
                store_job = functools.partial(run_jobs, worker, "store", ids, specs)
                load_job = functools.partial(run_jobs, worker, "load", ids, specs)
                store_s, write_s, store_paired = compare(store_job, plain.write, repeats)
                settle(load_job, plain.read)
                load_s, read_s, load_paired = compare(load_job, plain.read, 2 * repeats)
                if per_layer:  # the same bytes into the same scattered destination
                    into = functools.partial(plain.read_into, filled_kv(layout, num_blocks))
                    _, _, into_paired = compare(load_job, into, 2 * repeats)
                    row["load_ratio_vs_plain_readv_into_layout"] = round(into_paired, 3)
                threads = store.io_threads
                with ThreadPoolExecutor(threads) as pool:
                    for name, job, plain_io, pairs in (
                        ("store", store_job, plain.write_on, repeats),
                        ("load", load_job, plain.read_on, 2 * repeats),
                    ):
                        _, _, vs = compare(job, functools.partial(plain_io, pool, threads), pairs)
                        row[f"{name}_ratio_vs_plain_io_on_{threads}_threads"] = round(vs, 3)
            for name, ours, base, paired in (
                ("store", store_s, write_s, store_paired),
                ("load", load_s, read_s, load_paired),
            ):
                row[f"{name}_GBps"] = round(total / ours / 1e9, 3)
                row[f"{name}_baseline_GBps"] = round(total / base / 1e9, 3)
                row[f"{name}_best_ratio"] = round(base / ours, 3)
                row[f"{name}_ratio"] = round(paired, 3)
            rows.append(row)
            print(_line("disk", row))
            store.close()
            shutil.rmtree(directory)
            shutil.rmtree(plain.directory)
    return rows


def _worst(rows: list[dict[str, Any]], ratio: str) -> float:
    return float(min(min(r[f"store_{ratio}"], r[f"load_{ratio}"]) for r in rows))


def _line(tier: str, row: dict[str, Any]) -> str:
    what = " ".join(str(row[k]) for k in ("block", "layout", "device_ids") if k in row)
    return (
        f"{tier:6} {what:34} store {row['store_GBps']:6} GB/s ({row['store_ratio']:.0%} of "
        f"{row['store_baseline_GBps']})  load {row['load_GBps']:6} GB/s ({row['load_ratio']:.0%} "
        f"of {row['load_baseline_GBps']})"
        + "".join(
            f"  {key.replace('_ratio_vs_', ' vs ')} {row[key]:.0%}"
            for key in sorted(row)
            if "_ratio_vs_" in key
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller totals, fewer repeats")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the baseline copies get the same single thread as a worker
    # As an engine does after start-up (vLLM freezes its engine core's and workers' heaps,
    # vllm#24008): a full collection then skips the ~10^5 objects of torch and numpy,
    # instead of pausing one transfer (or one baseline copy) for ~70 ms now and then.
    gc.collect()
    gc.freeze()
    memory = bench_memory(args.quick)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        disk = bench_disk(args.quick, Path(tmp))
    summary = {
        "memory_min_ratio": _worst(memory, "ratio"),
        "memory_min_ratio_vs_one_contiguous_copy": _worst(memory, "ratio_vs_one_contiguous_copy"),
        "disk_min_ratio": _worst(disk, "ratio"),
        "disk_min_ratio_vs_plain_io_on_2_threads": _worst(disk, "ratio_vs_plain_io_on_2_threads"),
    }
    path = write_result(
        "store",
        {"quick": args.quick, "job_bytes": JOB_BYTES, "memory": memory, "disk": disk, **summary},
    )
    print(
        f"memory tier: worst {summary['memory_min_ratio']:.0%} of plain copies of the same "
        f"bytes (target 80%); {summary['memory_min_ratio_vs_one_contiguous_copy']:.0%} of one "
        "contiguous copy"
    )
    print(
        f"disk tier:   worst {summary['disk_min_ratio']:.0%} of plain sequential durable I/O "
        f"(target 70%); {summary['disk_min_ratio_vs_plain_io_on_2_threads']:.0%} of it on 2 "
        "threads"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
