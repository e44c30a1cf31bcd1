"""Offloading managers vs the vLLM reference port: trace replay and pinned-block cost.

1. Trace replay (the issue's loop, per request: lookup -> prepare_load/complete_load
   of the hits -> touch(all) -> prepare_store(the rest) -> complete_store) on the
   Mooncake conversation trace, for LRU and ARC at 1%, 5%, 10%, 25% of its unique
   blocks: block references per second, ours and the reference's, same run, and
   the hit counts (which must be identical).
2. kvtier's own policies beyond vLLM's (`reuse`) against kvtier's LRU, side by side
   the same way: block references per second as a share of LRU's, and hit rates.
3. Pinned blocks: a full cache with 0%, 50% or 90% of its blocks pinned at the
   least-recent end, then stores of fresh blocks that each force evictions: cost
   per stored block. The reference scans past every pinned block on every
   eviction; ours parks them once.

    .venv/bin/python -m benchmarks.bench_offload [--quick]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from tests.reference.vllm_offload import ReferenceCPUOffloadingManager

from benchmarks.common import CONVERSATION_TRACE, write_result
from kvtier.offload import CPUOffloadingManager
from kvtier.sim.traces import read_mooncake
from kvtier.types import BlockHash, int_block_hash

UNIQUE_BLOCKS = 182_790
FRACTIONS = (0.01, 0.05, 0.10, 0.25)
POLICIES = ("lru", "arc")
NEW_POLICIES = ("reuse",)  # no vLLM reference: timed against kvtier's LRU
CHUNK = 200  # requests per turn when the two sides alternate
Factory = Callable[[int, str], Any]
SIDES: dict[str, Factory] = {
    "kvtier": lambda n, p: CPUOffloadingManager(16, n, p),
    "reference": lambda n, p: ReferenceCPUOffloadingManager(16, n, p),
}


def capacity_for(fraction: float) -> int:
    return int(UNIQUE_BLOCKS * fraction)


def trace_hashes() -> list[list[BlockHash]]:
    return [[int_block_hash(h) for h in r.hash_ids] for r in read_mooncake(CONVERSATION_TRACE)]


def replay(manager: Any, requests: list[list[BlockHash]]) -> int:
    """The issue's per-request loop; returns the number of block hits."""
    hits = 0
    for hashes in requests:
        hits += replay_request(manager, hashes)
    return hits


def replay_request(manager: Any, hashes: list[BlockHash]) -> int:
    n: int = manager.lookup(hashes)
    if n:
        loaded = hashes[:n]
        manager.prepare_load(loaded)
        manager.complete_load(loaded)
    manager.touch(hashes)
    out = manager.prepare_store(hashes[n:])
    if out is not None:
        manager.complete_store(out.block_hashes_to_store)
    return n


def replay_side_by_side(
    policy: str, capacity: int, requests: list[list[BlockHash]], baseline: str | None = None
) -> tuple[float, float, int, int]:
    """Both managers replay the trace request by request, alternating, each timed.

    The machine is shared and its speed drifts by 2x within seconds; alternating
    every request exposes both sides to the same drift, so their ratio is stable
    even where the absolute rates are not. Returns (ours s, reference s, hits,
    reference hits), and fails on the first request where the two disagree. With
    `baseline`, the other side is kvtier under that policy, and hits may differ.
    """
    ours = SIDES["kvtier"](capacity, policy)
    ref = SIDES["reference"](capacity, policy) if baseline is None else None
    ref = SIDES["kvtier"](capacity, baseline) if ref is None else ref
    ref_hits = 0
    clock = time.perf_counter
    ours_s = ref_s = 0.0
    hits = 0
    for start in range(0, len(requests), CHUNK):
        chunk = requests[start : start + CHUNK]
        ours_first = start // CHUNK % 2 == 0  # alternate who goes first
        t0 = clock()
        n = replay(ours if ours_first else ref, chunk)
        t1 = clock()
        m = replay(ref if ours_first else ours, chunk)
        t2 = clock()
        if not ours_first:
            n, m = m, n
        ours_s += (t1 - t0) if ours_first else (t2 - t1)
        ref_s += (t2 - t1) if ours_first else (t1 - t0)
        if n != m and baseline is None:
            raise SystemExit(f"{policy}@{capacity}: requests {start}+: {n} hits != reference {m}")
        hits += n
        ref_hits += m
    return ours_s, ref_s, hits, ref_hits


def bench_replay(requests: list[list[BlockHash]], repeats: int) -> list[dict[str, Any]]:
    refs = sum(len(r) for r in requests)
    rows = []
    for policy in POLICIES:
        for fraction in FRACTIONS:
            capacity = capacity_for(fraction)
            runs = [replay_side_by_side(policy, capacity, requests) for _ in range(repeats)]
            ours = min(r[0] for r in runs)
            base = min(r[1] for r in runs)
            speedup = statistics.median(r[1] / r[0] for r in runs)
            hits = runs[0][2]
            rows.append(
                {
                    "policy": policy,
                    "capacity": capacity,
                    "hit_rate": hits / refs,
                    "refs_per_s": refs / ours,
                    "reference_refs_per_s": refs / base,
                    "speedup": speedup,
                    "speedups": [r[1] / r[0] for r in runs],
                }
            )
            print(
                f"replay {policy} cap={capacity:>6}: hit {hits / refs:.4f}  "
                f"ours {refs / ours / 1e3:5.0f}k refs/s  reference {refs / base / 1e3:5.0f}k  "
                f"speedup x{speedup:.2f} (median of {repeats})"
            )
    return rows


def bench_against_lru(requests: list[list[BlockHash]], repeats: int) -> list[dict[str, Any]]:
    """kvtier's own policies side by side with kvtier's LRU: speed share and hit rates."""
    refs = sum(len(r) for r in requests)
    rows = []
    for policy in NEW_POLICIES:
        for fraction in FRACTIONS:
            capacity = capacity_for(fraction)
            runs = [
                replay_side_by_side(policy, capacity, requests, baseline="lru")
                for _ in range(repeats)
            ]
            share = statistics.median(r[1] / r[0] for r in runs)
            rows.append(
                {
                    "policy": policy,
                    "capacity": capacity,
                    "hit_rate": runs[0][2] / refs,
                    "lru_hit_rate": runs[0][3] / refs,
                    "refs_per_s": refs / min(r[0] for r in runs),
                    "lru_refs_per_s": refs / min(r[1] for r in runs),
                    "share_of_lru": share,
                    "shares": [r[1] / r[0] for r in runs],
                }
            )
            print(
                f"replay {policy} cap={capacity:>6}: hit {runs[0][2] / refs:.4f} "
                f"(lru {runs[0][3] / refs:.4f})  {refs / min(r[0] for r in runs) / 1e3:5.0f}k "
                f"refs/s = {share:.0%} of lru's (median of {repeats})"
            )
    return rows


def pinned_run(side: str, policy: str, capacity: int, pinned: float, stores: int) -> float:
    """Microseconds per stored block in a full cache whose oldest `pinned` share is pinned.

    The fill touches its first quarter (so ARC has a T2), pins the oldest blocks,
    stores one warm-up batch (which parks the pinned blocks, once), then times
    `stores` batches of 16 fresh blocks, each evicting 16.
    """
    manager = SIDES[side](capacity, policy)
    fill = [int_block_hash(i) for i in range(capacity)]
    for i in range(0, capacity, 16):
        out = manager.prepare_store(fill[i : i + 16])
        manager.complete_store(out.block_hashes_to_store)
    manager.touch(fill[: capacity // 4])
    num_pinned = int(capacity * pinned)
    if num_pinned:
        manager.prepare_load(fill[:num_pinned])
    batches = [
        [int_block_hash(capacity + j * 16 + k) for k in range(16)] for j in range(stores + 1)
    ]
    out = manager.prepare_store(batches[0])
    manager.complete_store(out.block_hashes_to_store)
    start = time.perf_counter()
    for batch in batches[1:]:
        out = manager.prepare_store(batch)
        manager.complete_store(out.block_hashes_to_store)
    return (time.perf_counter() - start) / (stores * 16) * 1e6


def bench_pinned(quick: bool) -> list[dict[str, Any]]:
    capacity = 20_000
    rows = []
    for policy in POLICIES + NEW_POLICIES:
        sides = [("kvtier", 4000)]
        if policy in POLICIES:  # the reference has vLLM's policies only
            sides.append(("reference", 60 if quick else 200))
        for pinned in (0.0, 0.5, 0.9):
            row: dict[str, Any] = {"policy": policy, "capacity": capacity, "pinned": pinned}
            for side, stores in sides:
                runs = [pinned_run(side, policy, capacity, pinned, stores) for _ in range(3)]
                row[f"{side}_us_per_block"] = min(runs)  # the least disturbed of 3
                row[f"{side}_stores_timed"] = stores
            line = f"pinned {policy} {pinned:4.0%}: ours {row['kvtier_us_per_block']:6.2f} us/block"
            if policy in POLICIES:
                row["speedup"] = row["reference_us_per_block"] / row["kvtier_us_per_block"]
                line += f"  ref {row['reference_us_per_block']:8.2f} us/block"
            rows.append(row)
            print(line)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat, fewer pinned stores")
    args = parser.parse_args()
    requests = trace_hashes()
    gc.freeze()  # the trace is permanent: keep it out of every collection
    replay_rows = bench_replay(requests, repeats=1 if args.quick else 3)
    own_rows = bench_against_lru(requests, repeats=1 if args.quick else 3)
    pinned_rows = bench_pinned(args.quick)
    for policy in POLICIES + NEW_POLICIES:
        ours = {r["pinned"]: r["kvtier_us_per_block"] for r in pinned_rows if r["policy"] == policy}
        print(f"pinned {policy}: ours at 90% / at 0% pinned = {ours[0.9] / ours[0.0]:.2f}")
    path = write_result(
        "offload",
        {"quick": args.quick, "replay": replay_rows, "vs_lru": own_rows, "pinned": pinned_rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
