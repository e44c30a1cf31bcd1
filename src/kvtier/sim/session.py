"""What `kvtier replay` and `kvtier compare` compute, as plain functions and results.

The CLI only parses flags and renders these results; anything else that wants the
same answers (a notebook, a benchmark) calls these functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.sim.bounds import Bounds, belady_hits, compute_bounds, flatten
from kvtier.sim.generator import GeneratorConfig, generate_workload
from kvtier.sim.metrics import ReplayResult
from kvtier.sim.prefix_bound import prefix_min_hits
from kvtier.sim.replay_config import Progress, ReplayConfig
from kvtier.sim.run import replay
from kvtier.sim.workload import Workload, load_workload

# Makes one progress callback per replay: (label, total requests) -> callback.
ProgressFactory = Callable[[str, int], Progress]


def open_workload(
    trace: str | Path | None,
    fmt: str = "mooncake",
    *,
    limit: int | None = None,
    seed: int = 0,
    generator: GeneratorConfig | None = None,
) -> Workload:
    """The trace at `trace`, or the built-in generated workload when None."""
    if trace is None:
        return generate_workload(generator, seed=seed).limited(limit)
    return load_workload(trace, fmt, limit=limit)


def parse_policies(text: str) -> tuple[str, ...]:
    """`"lru,arc"` -> ("lru", "arc"); names are checked by the offload registry."""
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names:
        raise ValueError(f"no policy named in {text!r}; give e.g. 'lru' or 'lru,arc'")
    return names


@dataclass(frozen=True)
class ReplayReport:
    trace: str
    requests: int
    block_refs: int
    unique_blocks: int
    bounds: Bounds
    results: tuple[ReplayResult, ...]
    config: ReplayConfig

    def to_json(self) -> dict[str, Any]:
        """The `kvtier replay --json` document (schema fixed by issue 5, extra keys added)."""
        return {
            "trace": self.trace,
            "requests": self.requests,
            "block_refs": self.block_refs,
            "unique_blocks": self.unique_blocks,
            "capacity": {
                "gpu_blocks": self.config.gpu_blocks,
                "total_blocks": self.bounds.capacity,
            },
            "bounds": {
                "infinite": self.bounds.infinite,
                "belady": self.bounds.belady,
                "infinite_prefix": self.bounds.infinite_prefix,
                # the prefix-aware bound: the best prefix hit rate is in [prefix_min, belady]
                "prefix_min": self.bounds.prefix_min,
                "prefix_exact": self.bounds.prefix_exact,
                "assumptions": list(self.bounds.assumptions),
            },
            "results": [r.to_json() for r in self.results],
        }


def run_replays(
    workload: Workload,
    policies: Sequence[str],
    config: ReplayConfig,
    progress: ProgressFactory | None = None,
) -> ReplayReport:
    """Each policy replays the same workload; the bounds are at the same total capacity."""
    results = []
    for policy in policies:
        callback = progress(policy, len(workload.requests)) if progress else None
        results.append(replay(workload, replace(config, policy=policy), callback))
    return ReplayReport(
        trace=workload.name,
        requests=len(workload.requests),
        block_refs=workload.block_refs,
        unique_blocks=workload.unique_blocks,
        bounds=compute_bounds(
            workload, config.total_capacity(workload), config.bound_assumptions()
        ),
        results=tuple(results),
        config=config,
    )


@dataclass(frozen=True)
class SweepPoint:
    capacity: int
    fraction: float
    policy: str
    hit_rate: float
    prefix_hit_rate: float
    token_hit_rate: float


@dataclass(frozen=True)
class SweepReport:
    trace: str
    block_refs: int
    unique_blocks: int
    infinite: float
    # capacity -> Belady MIN hit rate at that capacity
    belady: dict[int, float]
    points: tuple[SweepPoint, ...]
    # capacity -> prefix MIN's prefix hit rate (the prefix-aware bound's lower end)
    prefix_min: dict[int, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "block_refs": self.block_refs,
            "unique_blocks": self.unique_blocks,
            "bounds": {
                "infinite": self.infinite,
                "belady": {str(c): v for c, v in self.belady.items()},
                "prefix_min": {str(c): v for c, v in self.prefix_min.items()},
            },
            "results": [p.__dict__ for p in self.points],
        }


def sweep(
    workload: Workload,
    policies: Sequence[str],
    capacities: Sequence[int],
    config: ReplayConfig | None = None,
    progress: ProgressFactory | None = None,
) -> SweepReport:
    """capacities x policies on one workload (offload tier only), with both bounds."""
    base = config or ReplayConfig()
    refs = flatten(workload)
    belady = {c: belady_hits(refs, c) / max(1, workload.block_refs) for c in capacities}
    prefix_min = {
        c: prefix_min_hits(workload.block_ids, c) / max(1, workload.block_refs) for c in capacities
    }
    points = []
    for capacity in capacities:
        for policy in policies:
            label = f"{policy} @ {capacity}"
            callback = progress(label, len(workload.requests)) if progress else None
            cfg = replace(base, policy=policy, cpu_blocks=capacity, cpu_frac=None)
            r = replay(workload, cfg, callback)
            points.append(
                SweepPoint(
                    capacity,
                    capacity / max(1, workload.unique_blocks),
                    policy,
                    r.hit_rate,
                    r.prefix_hit_rate,
                    r.token_hit_rate,
                )
            )
    bounds = compute_bounds(workload, 0)
    return SweepReport(
        workload.name,
        workload.block_refs,
        workload.unique_blocks,
        bounds.infinite,
        belady,
        tuple(points),
        prefix_min,
    )


def capacities_from_fractions(workload: Workload, fractions: Sequence[float]) -> list[int]:
    """Fractions of the unique blocks as block counts (the published figures' convention)."""
    for f in fractions:
        if not 0 < f <= 1:
            raise ValueError(f"capacity fraction must be in (0, 1], got {f}")
    return [max(1, int(workload.unique_blocks * f)) for f in fractions]
