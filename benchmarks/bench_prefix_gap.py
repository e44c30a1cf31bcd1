"""The gap between online policies and the prefix-aware bound, and what would close it.

    .venv/bin/python -m benchmarks.bench_prefix_gap [--quick]

Writes benchmarks/results/prefix_gap.json. For the public conversation trace and a
held-out generated trace (seed 7, mix 0.5/0.2/0.3 of chats, agents and documents,
6,000 requests: a seed and mix no policy was tuned on), at 1%, 5%, 10% and 25% of
each trace's unique blocks, no accelerator tier:

- the online policies' prefix hit rates (`kvtier replay`'s own loop, every
  registered policy or `--policy`);
- the prefix-aware bound (`kvtier.sim.prefix_bound`): prefix MIN and Belady, and
  whether they meet (then the optimum is known exactly);
- issue 35's target, the midpoint of LRU and the bound's upper end;
- an *admission oracle*: kvtier's LRU manager offered only the blocks that some
  later request uses (it knows whether a block comes back, not when). How much of
  the gap knowing the admission answer alone closes.

No figure here is timed; the JSON is the table the README quotes. (--quick: the
first 3,000 requests of each trace.)
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import CONVERSATION_TRACE, write_result
from kvtier.offload import CPUOffloadingManager
from kvtier.offload.policies import available_policies
from kvtier.sim import GeneratorConfig, ReplayConfig, generate_workload, load_workload, replay
from kvtier.sim.bounds import compute_bounds
from kvtier.sim.workload import Workload

FRACTIONS = (0.01, 0.05, 0.10, 0.25)
HELD_OUT = GeneratorConfig(num_requests=6000, mix=(0.5, 0.2, 0.3))
HELD_OUT_SEED = 7


def used_again(workload: Workload) -> list[list[bool]]:
    """For each request and block: whether a later request uses that block."""
    later: set[int] = set()
    flags: list[list[bool]] = []
    for ids in reversed(workload.block_ids):
        flags.append([b in later for b in ids])
        later.update(ids)
    flags.reverse()
    return flags


def admission_oracle_hits(workload: Workload, capacity: int, again: list[list[bool]]) -> int:
    """Prefix hits of kvtier's LRU manager storing only blocks used again (the replay's
    loop otherwise: lookup, load the hits, touch all, store the rest)."""
    manager = CPUOffloadingManager(workload.block_size, capacity, "lru")
    hits = 0
    for hashes, flags in zip(workload.block_hashes, again, strict=True):
        n = manager.lookup(hashes) or 0
        if n:
            manager.prepare_load(hashes[:n])
            manager.complete_load(hashes[:n])
        manager.touch(hashes)
        wanted = [h for h, keep in zip(hashes[n:], flags[n:], strict=True) if keep]
        out = manager.prepare_store(wanted)
        if out is not None:
            manager.complete_store(out.block_hashes_to_store)
        hits += n
    return hits


def measure(workload: Workload, policies: list[str]) -> list[dict[str, Any]]:
    refs = workload.block_refs
    again = used_again(workload)
    rows = []
    for fraction in FRACTIONS:
        capacity = max(1, int(workload.unique_blocks * fraction))
        online = {
            p: replay(workload, ReplayConfig(p, cpu_blocks=capacity)).prefix_hit_rate
            for p in policies
        }
        bounds = compute_bounds(workload, capacity)
        target = (online["lru"] + bounds.belady) / 2 if "lru" in online else None
        row = {
            "fraction": fraction,
            "capacity": capacity,
            "online": online,
            "prefix_min": bounds.prefix_min,
            "belady": bounds.belady,
            "prefix_exact": bounds.prefix_exact,
            "target": target,
            "admission_oracle": admission_oracle_hits(workload, capacity, again) / refs,
        }
        rows.append(row)
        cells = "  ".join(f"{p} {v:.4f}" for p, v in online.items())
        print(
            f"{workload.name} {fraction:4.0%} ({capacity:,} blocks): {cells}  "
            f"bound [{bounds.prefix_min:.4f}, {bounds.belady:.4f}]"
            f"{' exact' if bounds.prefix_exact else ''}  target "
            f"{'-' if target is None else f'{target:.4f}'}  "
            f"admission oracle {row['admission_oracle']:.4f}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first 3,000 requests")
    parser.add_argument("--policy", default="", help="comma list (default: every registered)")
    args = parser.parse_args(argv)
    policies = [p for p in args.policy.split(",") if p] or available_policies()
    limit = 3000 if args.quick else None
    traces = {
        "public": load_workload(CONVERSATION_TRACE, limit=limit),
        "held_out": generate_workload(HELD_OUT, seed=HELD_OUT_SEED).limited(limit),
    }
    results = {name: measure(w, policies) for name, w in traces.items()}
    path = write_result(
        "prefix_gap",
        {
            "quick": args.quick,
            "held_out": {"seed": HELD_OUT_SEED, "config": repr(HELD_OUT)},
            "traces": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
