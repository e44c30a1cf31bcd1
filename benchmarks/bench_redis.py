"""Remote tier bandwidth vs plain redis-py pipelined SET/GET, same bytes, same server, same run.

    .venv/bin/python -m benchmarks.bench_redis [--quick]

Starts its own redis-server on a free loopback port (no persistence). For 256 KiB
and 2 MiB blocks, each round writes then reads the same blocks in jobs of
`--batch` blocks, through:
- `tier`: `RedisKVStore.write_blocks` / `read_blocks`, what the transfer worker
  calls (header + xxh3 checksum on store; verification and the copy into the
  destination row on load);
- `plain`: `pipeline.set(...)` / `pipeline.get(...)` of the same payloads, nothing else;
- `heads`: the same blocks kept by KV head (`kvtier.remote.head_keys`, `--heads` heads,
  as engines of any tensor-parallel size share them), moved by one worker holding every
  head (`HeadShardKVStore`: one value a block, each head with its own checksum): what
  sharing across layouts costs an engine that reads its own layout's blocks;
- `cross`, `cross_last`: a worker of a two-worker engine loading its half of the heads
  (the first half, the last) from those values, told where they are as the scheduler's
  lookup tells an engine's workers (`HeadKeyedStore.holders_of`): one GETRANGE a block
  for the first half (its range follows the header), a header and a range for the last:
  what reading another layout's blocks costs (load only);
- `gather`: the reverse, a one-worker engine loading whole blocks that a two-worker
  engine wrote (its two workers' half values, stored by the side's store): two source
  values a block, each worker's heads copied straight into place.
One round trip per job on every side.
Sides alternate job by job (so all see the same background noise); the best
repetition of each counts (the machine is shared and noisy).
Target: tier >= 70% of plain in both directions. `cpu_seconds_per_gb`: the client's own
CPU (this thread's) per GB moved, each side. The lookups compare a prefix walk of
one value per block, of one value per head, and plain pipelined EXISTS.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import redis

from benchmarks.common import write_result
from kvtier.remote.codec import HEADER_SIZE
from kvtier.remote.head_codec import HeadGroup, header_size
from kvtier.remote.head_keys import HeadKeyedStore
from kvtier.remote.head_shard import HeadShard
from kvtier.remote.proxy_process import check_nice
from kvtier.remote.remote_manager import RemoteLoadStoreSpec
from kvtier.remote.tier import RemoteTier
from kvtier.store.layout import KVLayout
from kvtier.types import int_block_hash

TARGET = 0.70
HEADS = 8  # the KV heads of `layout_for`'s blocks (`--heads`: as many values a block)


@contextmanager
def redis_server(nice: int = 0) -> Iterator[int]:
    """A throwaway redis-server on a free loopback port; yields the port. `nice`: the
    niceness it runs at, every thread of it (19: it takes only what others leave)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "redis-server not found: apt-get install redis-server (or make redis-server)"
        )
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory() as workdir:
        cmd = ["nice", "-n", str(check_nice(nice)), binary, "--port", str(port)]
        cmd += ["--bind", "127.0.0.1", "--save", "", "--dir", workdir]
        proc = subprocess.Popen(
            [*cmd, "--appendonly", "no"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if "Ready to accept connections" in line:
                    break
            else:
                raise SystemExit(f"redis-server failed to start on port {port}")
            # keep reading its log, or a chatty server blocks on a full pipe mid-benchmark
            drain = threading.Thread(target=deque, args=(proc.stdout, 0), daemon=True)
            drain.start()
            yield port
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def layout_for(block_bytes: int) -> KVLayout:
    """A layout whose blocks are exactly `block_bytes` (fp16, 8 heads x 128, 16 tokens)."""
    per_layer_bytes = 2 * 16 * 8 * 128 * 2  # K and V planes of one layer
    return KVLayout(
        num_layers=block_bytes // per_layer_bytes,
        num_kv_heads=8,
        head_size=128,
        block_size=16,
        model_id="bench",
        per_layer=False,
    )


def timed(fn: Callable[[int], None], job: int) -> tuple[float, float]:
    """Wall and CPU seconds (this thread's, user and system: the client's own work,
    which runs on an engine's cores where a store shares them with its compute)."""
    start, cpu = time.perf_counter(), time.thread_time()
    fn(job)
    return time.perf_counter() - start, time.thread_time() - cpu


def bench_size(
    port: int, block_bytes: int, num_blocks: int, batch: int, repeats: int, heads: int = HEADS
) -> dict[str, Any]:
    layout = layout_for(block_bytes)
    assert layout.bytes_per_block == block_bytes
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    sources = [memoryview(rows[i]) for i in range(num_blocks)]
    dest = np.zeros_like(rows)
    dests = [memoryview(dest[i]) for i in range(num_blocks)]
    hashes = [int_block_hash(i) for i in range(num_blocks)]
    batches = [range(i, min(i + batch, num_blocks)) for i in range(0, num_blocks, batch)]
    url = f"redis://127.0.0.1:{port}/0"
    tier = RemoteTier.from_url(url, layout, block_size=16, socket_timeout_s=30.0)
    kv_store = tier.kv_store(layout)
    by_head = RemoteTier.from_url(url, layout, block_size=16, socket_timeout_s=30.0, heads=heads)
    head_store = by_head.head_store(layout, HeadShard(heads, 0, heads))
    half = heads // 2  # (`cross`: none when a block is one head)
    halves = np.zeros((num_blocks, block_bytes // 2), dtype=np.uint8)
    half_dests = [memoryview(halves[i]) for i in range(num_blocks)]
    by_half = RemoteTier.from_url(
        url, layout, block_size=16, socket_timeout_s=30.0, heads=heads, group_heads=max(half, 1)
    )
    half_store = by_half.head_store(layout_for(block_bytes // 2), HeadShard(heads, 0, half or 1))
    last_store = by_half.head_store(layout_for(block_bytes // 2), HeadShard(heads, half, half or 1))
    last_halves = np.zeros_like(halves)
    last_dests = [memoryview(last_halves[i]) for i in range(num_blocks)]
    specs = [RemoteLoadStoreSpec([hashes[i] for i in b]) for b in batches]
    told = [RemoteLoadStoreSpec([hashes[i] for i in b]) for b in batches]
    for spec in told:  # where the lookup found them: one value of every head
        spec.holders = [heads] * len(spec.block_hashes)
    # `gather`: blocks of their own (other hashes), written by halves
    gathered = [int_block_hash(num_blocks + i) for i in range(num_blocks)]
    gather_specs = [RemoteLoadStoreSpec([gathered[i] for i in b]) for b in batches]
    for spec in gather_specs:
        spec.holders = [max(half, 1)] * len(spec.block_hashes)
    gather_dest = np.zeros_like(rows)
    gather_dests = [memoryview(gather_dest[i]) for i in range(num_blocks)]
    plain = redis.Redis(host="127.0.0.1", port=port)
    plain_keys = [b"plain:" + h.hex().encode() for h in hashes]

    def tier_store(n: int) -> None:
        kv_store.write_blocks(specs[n], [sources[i] for i in batches[n]])

    def tier_load(n: int) -> None:
        kv_store.read_blocks(specs[n], [dests[i] for i in batches[n]])

    def heads_store(n: int) -> None:
        head_store.write_blocks(specs[n], [sources[i] for i in batches[n]])

    def heads_load(n: int) -> None:
        head_store.read_blocks(specs[n], [dests[i] for i in batches[n]])

    def cross_load(n: int) -> None:
        half_store.read_blocks(told[n], [half_dests[i] for i in batches[n]])

    def cross_last_load(n: int) -> None:
        last_store.read_blocks(told[n], [last_dests[i] for i in batches[n]])

    def gather_store(n: int) -> None:
        mid = block_bytes // 2
        half_store.write_blocks(gather_specs[n], [sources[i][:mid] for i in batches[n]])
        last_store.write_blocks(gather_specs[n], [sources[i][mid:] for i in batches[n]])

    def gather_load(n: int) -> None:
        head_store.read_blocks(gather_specs[n], [gather_dests[i] for i in batches[n]])

    def plain_store(n: int) -> None:
        pipe = plain.pipeline(transaction=False)
        for i in batches[n]:
            pipe.set(plain_keys[i], sources[i])
        pipe.execute()

    def plain_load(n: int) -> None:
        pipe = plain.pipeline(transaction=False)
        for i in batches[n]:
            pipe.get(plain_keys[i])
        pipe.execute()

    sides = {
        "tier": (tier_store, tier_load),
        "heads": (heads_store, heads_load),
        "plain": (plain_store, plain_load),
    }
    if half:
        sides["cross"] = (lambda n: None, cross_load)  # reads what `heads` wrote
        sides["cross_last"] = (lambda n: None, cross_last_load)
        sides["gather"] = (gather_store, gather_load)
    times: dict[str, list[float]] = {f"{s}_{d}": [] for s in sides for d in ("store", "load")}
    cpu_times: dict[str, list[float]] = {key: [] for key in times}
    for _ in range(repeats):
        plain.flushall()
        for direction in (0, 1):  # all stores, then all loads
            spent = dict.fromkeys(sides, 0.0)
            cpu = dict.fromkeys(sides, 0.0)
            for n in range(len(batches)):
                # rotate which side goes first, job by job: all see the same noise
                order, first = sorted(sides), n % len(sides)
                for side in order[first:] + order[:first]:
                    wall, used = timed(sides[side][direction], n)
                    spent[side] += wall
                    cpu[side] += used
            for side, seconds in spent.items():
                key = f"{side}_{('store', 'load')[direction]}"
                times[key].append(seconds)
                cpu_times[key].append(cpu[side])
    assert np.array_equal(dest, rows), "tier load returned different bytes"
    if half:
        assert np.array_equal(halves, rows[:, : block_bytes // 2]), "cross load: other bytes"
        assert np.array_equal(last_halves, rows[:, block_bytes // 2 :]), "cross_last: other bytes"
        assert np.array_equal(gather_dest, rows), "gather load: other bytes"
    for stats in (tier.stats, by_head.stats, by_half.stats):
        assert stats.corrupt_blocks == stats.errors == 0
    key_bytes = len(tier.store.key(hashes[0]))
    assert isinstance(by_head.store, HeadKeyedStore)
    head_key_bytes = len(by_head.store.group_key(hashes[0], HeadGroup(0, heads)))
    for t in (tier, by_head, by_half):
        t.close()
    plain.close()
    total = block_bytes * num_blocks
    loads_only = ("cross_store", "cross_last_store")
    gbps = {k: total / min(v) / 1e9 for k, v in times.items() if k not in loads_only}
    if half:
        gbps["cross_load"] /= 2  # half of each block's bytes
        gbps["cross_last_load"] /= 2
    return {
        # what one block costs on the wire and in Redis besides its bytes: key and header
        # (one engine's values; a two-worker engine writes two, of half the heads each)
        "overhead_bytes_per_block": {
            "tier": key_bytes + HEADER_SIZE,
            "heads": head_key_bytes + header_size(heads),
            "heads_two_workers": 2 * (head_key_bytes + header_size(half)) if half else None,
        },
        "heads_store_ratio": gbps["heads_store"] / gbps["tier_store"],
        "heads_load_ratio": gbps["heads_load"] / gbps["tier_load"],
        "cross_load_ratio": gbps["cross_load"] / gbps["tier_load"] if half else None,
        "cross_last_load_ratio": gbps["cross_last_load"] / gbps["tier_load"] if half else None,
        "gather_load_ratio": gbps["gather_load"] / gbps["tier_load"] if half else None,
        "block_bytes": block_bytes,
        "num_blocks": num_blocks,
        "batch_blocks": batch,
        "repeats": repeats,
        "gb_per_s": gbps,
        "median_gb_per_s": {
            k: total / float(np.median(v)) / 1e9 / (2 if k.startswith("cross") else 1)
            for k, v in times.items()
            if k not in loads_only
        },
        # the client's CPU per GB moved (median over the repeats): what the engine's
        # cores pay for the tier, beside what the redis-server pays on its own
        "cpu_seconds_per_gb": {
            k: float(np.median(v)) / (total / 1e9)
            for k, v in cpu_times.items()
            if k not in loads_only
        },
        "store_ratio": gbps["tier_store"] / gbps["plain_store"],
        "load_ratio": gbps["tier_load"] / gbps["plain_load"],
    }


def bench_lookup(port: int, prefix_blocks: int, repeats: int, heads: int = HEADS) -> dict[str, Any]:
    """Per-block cost of a prefix lookup (one round trip) vs plain pipelined EXISTS.

    Not a target, a profile: the lookup runs on the scheduler's thread. The plain
    side only asks "does each key exist" (no header check, no stop at a hole).
    """
    url = f"redis://127.0.0.1:{port}/0"
    tier = RemoteTier.from_url(url, "bench-lookup", block_size=16, socket_timeout_s=30.0)
    by_head = RemoteTier.from_url(
        url, "bench-lookup", block_size=16, socket_timeout_s=30.0, heads=heads
    )
    hashes = [int_block_hash(10**6 + i) for i in range(prefix_blocks)]
    tier.store.store(hashes, [b"\0" * 64] * prefix_blocks)
    by_head.store.store(hashes, [b"\0" * 64 * heads] * prefix_blocks)
    plain = redis.Redis(host="127.0.0.1", port=port)
    keys = [tier.store.key(h) for h in hashes]

    def plain_exists() -> None:
        pipe = plain.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        pipe.execute()

    best = {"tier": float("inf"), "heads": float("inf"), "plain": float("inf")}
    for _ in range(repeats):
        start = time.perf_counter()
        hits = tier.store.count_prefix(hashes)
        best["tier"] = min(best["tier"], time.perf_counter() - start)
        start = time.perf_counter()
        head_hits = by_head.store.count_prefix(hashes)
        best["heads"] = min(best["heads"], time.perf_counter() - start)
        start = time.perf_counter()
        plain_exists()
        best["plain"] = min(best["plain"], time.perf_counter() - start)
        assert hits == head_hits == prefix_blocks
    tier.close()
    by_head.close()
    plain.close()
    return {
        "prefix_blocks": prefix_blocks,
        "us_per_lookup": {k: v * 1e6 for k, v in best.items()},
        "us_per_block": {k: v * 1e6 / prefix_blocks for k, v in best.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and bytes")
    parser.add_argument("--batch", type=int, default=8, help="blocks per store/load job")
    parser.add_argument(
        "--heads", type=int, default=HEADS, help="KV heads a block is kept as (the heads side)"
    )
    args = parser.parse_args()
    repeats = 3 if args.quick else 9
    total = (32 if args.quick else 128) << 20  # bytes moved per direction per repetition
    results = []
    with redis_server() as port:
        for block_bytes in (256 << 10, 2 << 20):
            blocks = total // block_bytes
            results.append(bench_size(port, block_bytes, blocks, args.batch, repeats, args.heads))
        lookups = [bench_lookup(port, n, 10 * repeats, args.heads) for n in (16, 256)]
    passed = all(min(r["store_ratio"], r["load_ratio"]) >= TARGET for r in results)
    path = write_result(
        "bench_redis",
        {
            "target_ratio": TARGET,
            "passed": passed,
            "quick": args.quick,
            "heads": args.heads,
            "sizes": results,
            "lookups": lookups,
        },
    )
    for r in results:
        g = r["gb_per_s"]
        print(
            f"{r['block_bytes'] >> 10:>5} KiB blocks: store {g['tier_store']:.2f} vs "
            f"{g['plain_store']:.2f} GB/s ({r['store_ratio']:.0%}), load {g['tier_load']:.2f} vs "
            f"{g['plain_load']:.2f} GB/s ({r['load_ratio']:.0%}); by head: store "
            f"{g['heads_store']:.2f} GB/s ({r['heads_store_ratio']:.0%} of one value a block), "
            f"load {g['heads_load']:.2f} GB/s ({r['heads_load_ratio']:.0%}); key and header "
            f"bytes a block {r['overhead_bytes_per_block']['tier']} vs "
            f"{r['overhead_bytes_per_block']['heads']}"
            + (
                ""
                if r["cross_load_ratio"] is None
                else f"; half the heads from another layout's values: load "
                f"{g['cross_load']:.2f} GB/s ({r['cross_load_ratio']:.0%}), the last half "
                f"{g['cross_last_load']:.2f} GB/s ({r['cross_last_load_ratio']:.0%}); whole "
                f"blocks from a two-worker engine's values: {g['gather_load']:.2f} GB/s "
                f"({r['gather_load_ratio']:.0%})"
            )
        )
    for lk in lookups:
        us = lk["us_per_block"]
        print(
            f"lookup of {lk['prefix_blocks']} blocks: {us['tier']:.1f} us/block "
            f"(by head: {us['heads']:.1f}; plain pipelined EXISTS {us['plain']:.1f} us/block)"
        )
    print(
        f"target >= {TARGET:.0%} of plain redis-py: {'met' if passed else 'NOT met'}; wrote {path}"
    )


if __name__ == "__main__":
    main()
