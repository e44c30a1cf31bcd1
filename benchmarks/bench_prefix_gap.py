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
  the gap knowing the admission answer alone closes;
- how well the request-level signals an online policy could read tell, when a block
  is first stored, whether it comes back (`signals`), and how far apart reuses are;
- hit-density eviction (`benchmarks/hit_density.py`) told when each block comes back
  (to a factor of 2: `density_next_use`) against the same eviction on the classes an
  online policy can read (`density_online`): whether the mechanism or the signal is
  what an online policy lacks;
- the class ceilings (`benchmarks/class_ceiling.py`): the most block hits any policy
  that tells blocks apart only by a class can reach, in hindsight, for five class
  sets: `uses` (`reuse`'s own signals), `online` (hit density's online classes),
  `signals` (every request-level signal together), `signals_by_tenth` (the same,
  with rules that may change every tenth of the trace) and `next_use` (told when,
  to a factor of 2).

No figure here is timed; the JSON is the table the README quotes. (--quick: the
first 3,000 requests of each trace.)
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from typing import Any

from benchmarks.class_ceiling import SignalClasses, UseClasses, class_ceiling
from benchmarks.common import CONVERSATION_TRACE, write_result
from benchmarks.hit_density import Classify, NextUseClasses, OnlineClasses, density_hits
from benchmarks.past_rules import past_rules_hits
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


def _bucket(value: float, edges: tuple[float, ...]) -> str:
    for edge in edges:
        if value < edge:
            return f"<{edge:g}"
    return f">={edges[-1]:g}"


def _order(bucket: str) -> tuple[bool, float, bool]:
    """Buckets in the order of their edges ("none" last)."""
    if bucket == "none":
        return (True, 0.0, False)
    return (False, float(bucket.lstrip("<>=")), bucket.startswith(">="))


def signals(workload: Workload) -> dict[str, Any]:
    """Share of first-seen blocks used again, by each signal an online policy can read
    when it stores them: relative depth in the request's new part, conversation turn
    (1 + the turn of the request that last used the deepest block it hit; 1 when it hit
    at most the first block), size of the new part, uses of the deepest hit block. A
    request's last block is left out (partial in most traces and rarely reused: `reuse`
    already tells it apart). Also: the chance of one more use after k uses, and the
    requests between a block's use and its next (the first block excluded)."""
    again = used_again(workload)
    uses: Counter[int] = Counter()
    last_use: dict[int, int] = {}
    turn = [1] * len(workload.block_ids)
    gaps: list[int] = []
    tallies: dict[str, dict[str, list[int]]] = {}

    def tally(signal: str, bucket: str, reused: bool) -> None:
        counts = tallies.setdefault(signal, {}).setdefault(bucket, [0, 0])
        counts[0] += 1
        counts[1] += reused

    for t, (ids, flags) in enumerate(zip(workload.block_ids, again, strict=True)):
        n, m = len(ids), 0
        while m < n and ids[m] in last_use:
            m += 1
        gaps += [t - last_use[b] for b in ids[1:m]]
        head = ids[m - 1] if m >= 2 else None
        if head is not None:
            turn[t] = 1 + turn[last_use[head]]
        for j in range(m, n - 1):
            reused = flags[j]
            tally("depth_in_new_part", _bucket((j - m) / (n - m), (0.25, 0.5, 0.75)), reused)
            tally("turn", _bucket(turn[t], (2, 3, 4)), reused)
            tally("new_blocks", _bucket(n - m, (8, 32, 128)), reused)
            shared = "none" if head is None else _bucket(uses[head], (2, 5))
            tally("uses_of_deepest_hit", shared, reused)
        for b in ids:
            uses[b] += 1
            last_use[b] = t
    counts = Counter(min(c, 5) for c in uses.values())
    at_least = {k: sum(v for c, v in counts.items() if c >= k) for k in range(1, 6)}
    quartiles = statistics.quantiles(gaps, n=4) if len(gaps) > 1 else []
    return {
        "used_again_share": {
            signal: {
                b: {"blocks": c, "used_again": r / c}
                for b, (c, r) in sorted(buckets.items(), key=lambda item: _order(item[0]))
            }
            for signal, buckets in tallies.items()
        },
        "one_more_use_after_k": {
            str(k): at_least[k + 1] / at_least[k] for k in range(1, 5) if at_least[k]
        },
        "reuse_gap_requests_quartiles": quartiles,
    }


def ceiling_classes(workload: Workload, next_use: NextUseClasses) -> dict[str, Classify]:
    """The class sets of the ceilings (the online ones fresh: they keep state; `next_use`
    keeps none, and is built once a trace)."""
    return {
        "uses": UseClasses(),
        "online": OnlineClasses(),
        "signals": SignalClasses(),
        "signals_by_tenth": SignalClasses(segments=10, num_requests=len(workload.block_ids)),
        "next_use": next_use,
    }


def past_rules_classes() -> dict[str, Classify]:
    """The online class sets whose rules `past_rules_hits` learns from the past (fresh)."""
    return {"uses": UseClasses(), "online": OnlineClasses(), "signals": SignalClasses()}


def measure(workload: Workload, policies: list[str]) -> list[dict[str, Any]]:
    refs = workload.block_refs
    again = used_again(workload)
    next_use = NextUseClasses(workload.block_ids)
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
            "density_next_use": density_hits(workload.block_ids, capacity, next_use) / refs,
            "density_online": density_hits(workload.block_ids, capacity, OnlineClasses()) / refs,
            "class_ceilings": {
                name: class_ceiling(workload.block_ids, capacity, classify).hits / refs
                for name, classify in ceiling_classes(workload, next_use).items()
            },
            "past_rules": {
                name: past_rules_hits(workload.block_ids, capacity, classify) / refs
                for name, classify in past_rules_classes().items()
            },
        }
        rows.append(row)
        cells = "  ".join(f"{p} {v:.4f}" for p, v in online.items())
        print(
            f"{workload.name} {fraction:4.0%} ({capacity:,} blocks): {cells}  "
            f"bound [{bounds.prefix_min:.4f}, {bounds.belady:.4f}]"
            f"{' exact' if bounds.prefix_exact else ''}  target "
            f"{'-' if target is None else f'{target:.4f}'}  "
            f"admission oracle {row['admission_oracle']:.4f}  hit density: told when "
            f"{row['density_next_use']:.4f}, online classes {row['density_online']:.4f}  "
            "class ceilings: "
            + ", ".join(f"{k} {v:.4f}" for k, v in row["class_ceilings"].items())
            + "  learned from earlier tenths: "
            + ", ".join(f"{k} {v:.4f}" for k, v in row["past_rules"].items()),
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
    found = {name: signals(w) for name, w in traces.items()}
    for name, doc in found.items():
        print(f"{name}: reuse gap quartiles (requests) {doc['reuse_gap_requests_quartiles']}")
        print(f"{name}: one more use after k uses {doc['one_more_use_after_k']}")
        for signal, buckets in doc["used_again_share"].items():
            cells = "  ".join(
                f"{b} {v['used_again']:.3f} ({v['blocks']:,})" for b, v in buckets.items()
            )
            print(f"{name}: used again by {signal}: {cells}")
    path = write_result(
        "prefix_gap",
        {
            "quick": args.quick,
            "held_out": {"seed": HELD_OUT_SEED, "config": repr(HELD_OUT)},
            "traces": results,
            "signals": found,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
