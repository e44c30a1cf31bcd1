"""When the disk tier is written: `demote` (on CPU eviction) against `write_through`.

What decides the default of `disk_writes` (README, "Operating kvtier"): a restart must
find every block that was in the CPU tier, and the two ways there are `write_through`
(every CPU store also goes to disk) or `demote` plus a flush of the CPU tier at a clean
shutdown. Measured here, through kvtier's own cascade and data plane (the code the
vLLM connector runs), on blocks of Qwen2-0.5B's shape (24 layers, 2 KV heads of 64,
32 tokens, bf16: 384 KiB):

1. a stream of 8-block store jobs, each waited for (its blocks readable), with a CPU
   tier that holds the whole stream (`fits`) and one a quarter of it (`overflow`);
   per mode: seconds per job (median, p90), total seconds, and block files written.
   `demote` writes only what the CPU tier evicts; `write_through` writes every block
   as it is stored, and a job is done only when its files are durable (fsync).
2. `flush_s`: what a flush at shutdown costs, writing a full CPU tier to disk in jobs
   of 64 blocks (DiskStore.write, fsync'ed); `flush_s_per_gib` scales it.
3. `lost_at_restart`: blocks in the CPU tier only, lost by a restart without a flush.

Both modes run alternately, `--repeats` times each (best and median reported): the
machine is shared and its disk writes fast in bursts, then throttles.

    .venv/bin/python -m benchmarks.bench_disk_writes [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import write_result
from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.offload.policy_manager import CPUOffloadingManager
from kvtier.store.disk_store import DiskStore
from kvtier.store.layout import KVLayout
from kvtier.store.memory import MemoryStore
from kvtier.transfer.cascade_handler import CascadeHandler
from kvtier.transfer.device import DeviceKV, allocate_kv_caches
from kvtier.transfer.transfer_worker import TransferWorker
from kvtier.types import BlockHash

LAYOUT = KVLayout(num_layers=24, num_kv_heads=2, head_size=64, block_size=32, dtype="bfloat16")
JOB_BLOCKS = 8
FLUSH_JOB_BLOCKS = 64


def run_stream(root: Path, mode: str, cpu_blocks: int, num_jobs: int, seed: int) -> dict[str, Any]:
    """One stream of store jobs through a fresh cascade; its timings and disk writes."""
    caches = allocate_kv_caches(LAYOUT, JOB_BLOCKS)
    for cache in caches:
        cache.random_(generator=None)
    kv = DeviceKV(LAYOUT, caches)
    memory = MemoryStore(LAYOUT, cpu_blocks)
    disk_blocks = num_jobs * JOB_BLOCKS
    disk = DiskStore(root, LAYOUT, DiskStore.capacity_for(LAYOUT, disk_blocks))
    cascade = CascadeOffloadingManager(
        CPUOffloadingManager(LAYOUT.block_size, cpu_blocks),
        disk.manager(LAYOUT.block_size),
        disk_writes=mode,  # type: ignore[arg-type]
    )
    worker = TransferWorker(CascadeHandler(kv, memory, disk), ordered=True, torch_threads=1)
    rng = np.random.default_rng(seed)
    job_s: list[float] = []
    started = time.perf_counter()
    try:
        for job in range(num_jobs):
            hashes = [BlockHash(rng.bytes(32)) for _ in range(JOB_BLOCKS)]
            out = cascade.prepare_store(hashes)
            if out is None:
                raise RuntimeError(f"{mode}: the cascade refused store job {job}")
            begun = time.perf_counter()
            worker.submit_store(job, list(range(len(out.block_hashes_to_store))), out.store_spec)
            worker.wait([job])
            job_s.append(time.perf_counter() - begun)
            ((_, ok, _, _),) = worker.get_finished()
            if not ok:
                raise RuntimeError(f"{mode}: store job {job} failed: {list(worker.errors)}")
            cascade.complete_store(out.block_hashes_to_store)
        total_s = time.perf_counter() - started
        files = len(list(disk.directory.glob("*.kv")))
        in_cpu_only = sum(1 for h in cascade.held_keys() if h not in disk)
    finally:
        worker.close()
        disk.close()
    job_s.sort()
    return {
        "job_s_median": statistics.median(job_s),
        "job_s_p90": job_s[int(0.9 * (len(job_s) - 1))],
        "total_s": total_s,
        "block_files_written": files,
        "lost_at_restart": in_cpu_only,
    }


def flush_seconds(root: Path, cpu_blocks: int) -> float:
    """Write a full CPU tier's blocks to a fresh disk tier, as a shutdown flush would."""
    disk = DiskStore(root, LAYOUT, DiskStore.capacity_for(LAYOUT, cpu_blocks))
    rng = np.random.default_rng(1)
    payload = rng.bytes(LAYOUT.bytes_per_block)
    try:
        started = time.perf_counter()
        for first in range(0, cpu_blocks, FLUSH_JOB_BLOCKS):
            n = min(FLUSH_JOB_BLOCKS, cpu_blocks - first)
            hashes = [BlockHash(rng.bytes(32)) for _ in range(n)]
            disk.write(hashes, [payload] * n)
        return time.perf_counter() - started
    finally:
        disk.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="short streams, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    num_jobs = 16 if args.quick else 48
    repeats = args.repeats or (2 if args.quick else 4)
    stream_blocks = num_jobs * JOB_BLOCKS
    regimes = {"fits": stream_blocks + JOB_BLOCKS, "overflow": stream_blocks // 4}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {r: {} for r in regimes}
    base = Path(os.environ.get("KVTIER_BENCH_DIR", tempfile.gettempdir()))
    for repeat in range(repeats):
        for regime, cpu_blocks in regimes.items():
            modes = ["demote", "write_through"]
            if repeat % 2:
                modes.reverse()  # which goes first alternates
            for mode in modes:
                with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=base) as tmp:
                    row = run_stream(Path(tmp), mode, cpu_blocks, num_jobs, seed=repeat)
                runs[regime].setdefault(mode, []).append(row)
    results: dict[str, Any] = {}
    for regime, by_mode in runs.items():
        for mode, rows in by_mode.items():
            key = f"{regime}_{mode}"
            results[key] = {
                "cpu_blocks": regimes[regime],
                "stream_blocks": stream_blocks,
                "job_s_median": statistics.median(r["job_s_median"] for r in rows),
                "job_s_p90": statistics.median(r["job_s_p90"] for r in rows),
                "total_s_best": min(r["total_s"] for r in rows),
                "total_s_median": statistics.median(r["total_s"] for r in rows),
                "block_files_written": rows[-1]["block_files_written"],
                "lost_at_restart": rows[-1]["lost_at_restart"],
            }
    cpu_blocks = regimes["fits"]
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=base) as tmp:
        flush = min(flush_seconds(Path(tmp) / str(i), cpu_blocks) for i in range(repeats))
    gib = cpu_blocks * LAYOUT.bytes_per_block / (1 << 30)
    results["flush"] = {
        "cpu_blocks": cpu_blocks,
        "flush_s": flush,
        "flush_s_per_gib": flush / gib,
    }
    payload = {
        "block_bytes": LAYOUT.bytes_per_block,
        "job_blocks": JOB_BLOCKS,
        "repeats": repeats,
        "results": results,
    }
    path = write_result("bench_disk_writes", payload)
    for key, row in results.items():
        print(key, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
