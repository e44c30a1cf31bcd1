"""What a shared disk directory (`disk_shared`, `kvtier.store.shared_disk`) costs beside
a directory of one's own (`DiskStore`), for blocks of the 0.5B-shaped model (24 layers,
2 KV heads of 64, bfloat16, 32 tokens: 192 KiB a head, 384 KiB a block).

Rows, each against the single-owner `DiskStore` of the same blocks in the same run
(`ratio`: median over alternating pairs of baseline time / shared time; which side
goes first alternates):
- `load_same_layout`: a one-worker engine reads blocks one worker wrote (one file a
  block, one `readv`, each head's xxh3 checked instead of one over the block), into
  whole rows, and (`_segments`) into the engine's segments, as vLLM's CPU caches are;
- `load_tp1_from_tp2`: a one-worker engine reads blocks two workers wrote (two files a
  block: a header `pread` and a heads' range `preadv` each);
- `load_tp2_from_tp1`: one of two workers reads its head out of one worker's files,
  against that worker reading its own 192 KiB shard files;
- `store_same_layout`: writes, fsync'ed (file, then directory), as an engine's.
And what a scheduler-side lookup of a block it does not know costs (`probe_*_us`: a
`stat` a file; a miss asks every grouping), and the header bytes per file of each.

    .venv/bin/python -m benchmarks.bench_shared_disk [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import write_result
from kvtier.remote.head_codec import grouping, header_size
from kvtier.store.disk_store import DiskStore
from kvtier.store.diskformat import block_file_bytes
from kvtier.store.layout import KVLayout
from kvtier.store.shared_dir import probe, shared_directory
from kvtier.store.shared_disk import SharedDiskStore
from kvtier.types import BlockHash

LAYERS, HEADS, HEAD_DIM, TOKENS = 24, 2, 64, 32
SHARED = KVLayout(LAYERS, 1, HEAD_DIM, TOKENS, dtype="bfloat16", model_id="bench-heads")


def row(count: int) -> KVLayout:
    return KVLayout(LAYERS, 1, HEAD_DIM * count, TOKENS, dtype="bfloat16", model_id=f"r{count}")


def keys(n: int, seed: int) -> list[BlockHash]:
    rng = random.Random(seed)
    return [BlockHash(rng.randbytes(32)) for _ in range(n)]


def paired(ours: Callable[[], object], base: Callable[[], object], pairs: int) -> dict[str, float]:
    times = []
    for pair in range(pairs):
        order = [ours, base] if pair % 2 == 0 else [base, ours]
        took = {}
        for run in order:
            start = time.perf_counter()
            run()
            took[run] = time.perf_counter() - start
        times.append((took[ours], took[base]))
    return {
        "shared_best_s": min(t[0] for t in times),
        "own_best_s": min(t[1] for t in times),
        "ratio": statistics.median(b / o for o, b in times),
    }


def shared_engine(root: Path, count: int, blocks: int, fsync: bool) -> list[SharedDiskStore]:
    layout = row(count)
    capacity = blocks * (header_size(count) + layout.bytes_per_block)
    return [
        SharedDiskStore(root, SHARED, layout, HEADS, g, capacity, fsync=fsync)
        for g in grouping(HEADS, count)
    ]


def parts(layout: KVLayout, segments: bool) -> list[memoryview]:
    """A block's buffer: one row, or the engine's segments (a K and a V half a layer),
    as vLLM's CPU caches hand them to the disk tier."""
    whole = memoryview(bytearray(layout.bytes_per_block))
    if not segments:
        return [whole]
    size = layout.segment_bytes
    return [whole[i : i + size] for i in range(0, len(whole), size)]


def reader(
    stores: list[SharedDiskStore], hashes: list[BlockHash], segments: bool = False
) -> Callable[[], None]:
    buffers = [[parts(s.layout, segments) for _ in hashes] for s in stores]

    def read() -> None:
        for store, blocks in zip(stores, buffers, strict=True):
            store.read_parts(hashes, blocks)

    return read


def own_reader(
    store: DiskStore, hashes: list[BlockHash], segments: bool = False
) -> Callable[[], None]:
    buffers = [parts(store.layout, segments) for _ in hashes]
    return lambda: store.read_parts(hashes, buffers)


def bench(quick: bool, root: Path) -> dict[str, Any]:
    n, pairs = (16, 6) if quick else (64, 16)
    hashes = keys(n, 1)
    whole = [random.Random(i).randbytes(row(HEADS).bytes_per_block) for i in range(n)]
    half = [b[: len(b) // 2] for b in whole]  # bytes only: the shapes are what is timed
    own1 = DiskStore(root / "own1", row(HEADS), DiskStore.capacity_for(row(HEADS), 4 * n))
    own2 = DiskStore(root / "own2", row(1), DiskStore.capacity_for(row(1), 4 * n))
    own1.write(hashes, whole)
    own2.write(hashes, half)
    tp1 = shared_engine(root / "s1", HEADS, 4 * n, fsync=True)
    tp2 = shared_engine(root / "s2", 1, 4 * n, fsync=True)
    for store in tp1:
        store.write(hashes, whole)
    for store in tp2:
        store.write(hashes, half)
    rows = {
        "load_same_layout": paired(reader(tp1, hashes), own_reader(own1, hashes), pairs),
        "load_same_layout_segments": paired(
            reader(tp1, hashes, True), own_reader(own1, hashes, True), pairs
        ),
        "load_tp1_from_tp2": paired(
            reader(shared_engine(root / "s2", HEADS, 4 * n, False), hashes),
            own_reader(own1, hashes),
            pairs,
        ),
        "load_tp2_from_tp1": paired(
            reader(shared_engine(root / "s1", 1, 4 * n, False)[1:], hashes),
            own_reader(own2, hashes),
            pairs,
        ),
    }
    fresh = iter(range(1000, 10**9))

    def store_shared() -> None:
        tp1[0].write(keys(n // 4, next(fresh)), whole[: n // 4])

    def store_own() -> None:
        own1.write(keys(n // 4, next(fresh)), whole[: n // 4])

    rows["store_same_layout"] = paired(store_shared, store_own, max(4, pairs // 2))
    directory = shared_directory(root / "s2", SHARED)
    probes = 2000 if quick else 20000
    start = time.perf_counter()
    for i in range(probes):
        probe(directory, hashes[i % n], HEADS, 1)
    hit_us = (time.perf_counter() - start) / probes * 1e6
    missing = keys(probes, 2)
    start = time.perf_counter()
    for block_hash in missing:
        probe(directory, block_hash, HEADS, 1)
    miss_us = (time.perf_counter() - start) / probes * 1e6
    return {
        "blocks_per_job": n,
        "block_bytes": row(HEADS).bytes_per_block,
        "rows": rows,
        "probe_hit_us": hit_us,
        "probe_miss_us": miss_us,
        "header_bytes": {
            "own_directory": block_file_bytes(0, 32),
            "shared_one_head": header_size(1),
            "shared_two_heads": header_size(2),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-shared-", dir="/var/tmp") as root:
        result = bench(args.quick, Path(root))
    path = write_result("shared_disk", result)
    for name, found in result["rows"].items():
        print(
            f"{name:26s} shared {found['shared_best_s'] * 1e3:8.2f} ms  own "
            f"{found['own_best_s'] * 1e3:8.2f} ms  own/shared {found['ratio']:.2f}"
        )
    print(f"probe: hit {result['probe_hit_us']:.1f} us, miss {result['probe_miss_us']:.1f} us")
    print(f"header bytes: {result['header_bytes']}  -> {path}")


if __name__ == "__main__":
    main()
