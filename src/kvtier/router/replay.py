"""Many engines by replay: N replay stacks behind the router's own routing code.

Each engine is what `kvtier replay` builds for one (`kvtier.sim.stack.build_stack`:
its accelerator pool through the connector when `gpu_blocks` is set, its CPU tier,
its disk tier), all of them optionally over one shared Redis namespace. Every
request of the trace is routed by `kvtier.router.scoring.Chooser`, the class the
HTTP router decides with, from what each engine holds right then: its pool's prefix
cache, and the blocks its tiers' events say they hold (a block in Redis counts for
every engine, as in the router's index). The requests are served one at a time (the
tiers see them in arrival order, each done before the next); the router's load, its
requests in flight, is what the replay's time model says would still be running at
each arrival (`TimeModel`: the prefill of the tokens no tier served, then the decode),
so that a hot prefix spreads over engines as it would under real traffic.

Figures are per engine and in total; the bounds are those of one cache holding all
the engines' capacity together, which N separate caches cannot beat.

Engines of different sizes (`sizes`: each engine's tensor-parallel workers) serve one
model side by side: an engine of W workers has W times the pool, the CPU and the disk
blocks of `config` (each worker brings its accelerator's memory and its own per-worker
budgets, and holds 1/W of each block), while the shared Redis tier's blocks are every
engine's, whatever its size (kept by KV head, `kvtier.remote.head_keys`). The time model
is the same for every size.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.router.index import prefix_tiers_by
from kvtier.router.scoring import Chooser, Weights
from kvtier.router.tiers import Tier
from kvtier.sim.bounds import Bounds, compute_bounds
from kvtier.sim.bytes_plane import NoBytes
from kvtier.sim.ledger import Ledger
from kvtier.sim.replay_config import ReplayConfig, TimeModel
from kvtier.sim.run import new_ledger, new_step
from kvtier.sim.stack import TierStack, build_stack
from kvtier.sim.step import Step
from kvtier.sim.workload import Workload
from kvtier.types import BlockHash

_TIER_OF_MEDIUM = {"cpu": Tier.CPU, "disk": Tier.DISK}


@dataclass(frozen=True)
class EngineFigures:
    name: str
    requests: int
    block_refs: int  # of the requests routed here
    prefix_hit_blocks: int
    hit_tokens: int
    prefill_tokens_saved: int
    tier_hits: dict[str, int]  # blocks served by each tier
    workers: int = 1  # its tensor-parallel size

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_blocks / self.block_refs if self.block_refs else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "workers": self.workers,
            "requests": self.requests,
            "block_refs": self.block_refs,
            "prefix_hit_blocks": self.prefix_hit_blocks,
            "prefix_hit_rate": self.prefix_hit_rate,
            "hit_tokens": self.hit_tokens,
            "prefill_tokens_saved": self.prefill_tokens_saved,
            "tier_hits": dict(self.tier_hits),
        }


@dataclass(frozen=True)
class EnginesResult:
    router: str
    policy: str
    engines: tuple[EngineFigures, ...]
    assignment: tuple[str, ...]  # the engine of each request, in replay order ("" if dropped)
    bounds: Bounds
    block_refs: int
    unschedulable: int
    seconds: float

    @property
    def prefix_hit_blocks(self) -> int:
        return sum(e.prefix_hit_blocks for e in self.engines)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_blocks / self.block_refs if self.block_refs else 0.0

    @property
    def prefill_tokens_saved(self) -> int:
        return sum(e.prefill_tokens_saved for e in self.engines)

    def to_json(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "policy": self.policy,
            "engines": [e.to_json() for e in self.engines],
            "total": {
                "requests": sum(e.requests for e in self.engines),
                "block_refs": self.block_refs,
                "prefix_hit_blocks": self.prefix_hit_blocks,
                "prefix_hit_rate": self.prefix_hit_rate,
                "prefill_tokens_saved": self.prefill_tokens_saved,
                "unschedulable_requests": self.unschedulable,
            },
            "bounds": {
                "total_blocks": self.bounds.capacity,
                "infinite_prefix": self.bounds.infinite_prefix,
                "belady": self.bounds.belady,
                "prefix_min": self.bounds.prefix_min,
                "prefix_exact": self.bounds.prefix_exact,
                "assumptions": list(self.bounds.assumptions),
            },
            "seconds": self.seconds,
        }


@dataclass
class _Engine:
    name: str
    stack: TierStack
    ledger: Ledger
    step: Step
    in_pool: Callable[[BlockHash], bool]
    workers: int = 1
    requests: int = 0
    block_refs: int = 0
    running: list[float] = field(default_factory=list)  # a heap of end times (ms)

    def in_flight(self, now: float) -> int:
        while self.running and self.running[0] <= now:
            heapq.heappop(self.running)
        return len(self.running)


def replay_engines(
    workload: Workload,
    config: ReplayConfig,
    engines: int,
    router: str = "kv",
    weights: Weights | None = None,
    time_model: TimeModel | None = None,
    sizes: Sequence[int] | None = None,
) -> EnginesResult:
    """Replay `workload` over `engines` stacks built from `config`, routed by `router`;
    `time_model` (default `TimeModel()`) estimates the requests in flight; `sizes`: each
    engine's tensor-parallel workers (default one each), scaling its capacities."""
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    sizes = [1] * engines if sizes is None else list(sizes)
    if len(sizes) != engines or any(isinstance(w, bool) or w < 1 for w in sizes):
        raise ValueError(f"sizes must be {engines} worker counts >= 1, got {sizes}")
    if config.data or config.time_model is not None:
        raise ValueError(
            "a replay over several engines serves requests one at a time without bytes: "
            "--engines takes neither --data nor --concurrent"
        )
    chooser = Chooser(router, weights)
    timing = time_model or TimeModel()
    shared = config
    if config.redis_url is not None and config.redis_namespace is None:
        shared = replace(config, redis_namespace=f"replay-{uuid.uuid4().hex}")
    with contextlib.ExitStack() as closing:
        fleet = [
            _engine(f"e{i}", workload, scaled(shared, workload, workers), workers, closing)
            for i, workers in enumerate(sizes)
        ]
        names = [e.name for e in fleet]
        by_name = {e.name: e for e in fleet}
        assignment: list[str] = []
        unschedulable = 0
        started = time.perf_counter()
        for index in fleet[0].step.indexes():
            hashes = workload.block_hashes[index]
            request = workload.requests[index]
            now = request.timestamp
            prefix = functools.partial(_prefix, by_name, fleet, hashes)
            load = functools.partial(_in_flight, by_name, now)
            decision = chooser.choose(names, len(hashes), prefix, load)
            engine = by_name[decision.engine]
            pending = engine.step.admit(index)
            if pending is None:
                unschedulable += 1
                assignment.append("")
                continue
            busy = timing.prefill_ms(pending.uncached_tokens, pending.loaded_blocks)
            busy += timing.decode_ms(request.output_length)
            heapq.heappush(engine.running, now + busy)
            engine.step.loaded(pending)
            engine.step.computed(pending)
            engine.step.finished(pending)
            engine.requests += 1
            engine.block_refs += len(workload.block_ids[index])
            assignment.append(engine.name)
        seconds = time.perf_counter() - started
        figures = tuple(_figures(e) for e in fleet)
    per_engine = config.gpu_blocks + config.cpu_capacity(workload) + config.disk_blocks
    capacity = sum(sizes) * per_engine
    if config.redis_url is not None:
        capacity += workload.unique_blocks  # as one engine's bound counts Redis: unbounded
    bounds = compute_bounds(workload, capacity, config.bound_assumptions())
    return EnginesResult(
        router, config.policy, figures, tuple(assignment), bounds, workload.block_refs,
        unschedulable, seconds,
    )  # fmt: skip


def scaled(config: ReplayConfig, workload: Workload, workers: int) -> ReplayConfig:
    """The tiers of an engine of `workers` tensor-parallel workers: `config` is one
    worker's, and each worker adds its pool and its per-worker CPU and disk budgets."""
    if workers == 1:
        return config
    return replace(
        config,
        gpu_blocks=config.gpu_blocks * workers,
        cpu_blocks=config.cpu_capacity(workload) * workers,
        cpu_frac=None,
        disk_blocks=config.disk_blocks * workers,
    )


def _engine(
    name: str,
    workload: Workload,
    config: ReplayConfig,
    workers: int,
    closing: contextlib.ExitStack,
) -> _Engine:
    stack = build_stack(workload, config)
    closing.callback(stack.close)
    ledger = new_ledger(workload, config, stack)
    step, connector = new_step(workload, config, stack, NoBytes(), ledger)
    in_pool: Callable[[BlockHash], bool] = (
        connector.gpu.is_cached if connector is not None else _nowhere
    )
    return _Engine(name, stack, ledger, step, in_pool, workers)


def _nowhere(block_hash: BlockHash) -> bool:
    return False


def _in_flight(by_name: dict[str, _Engine], now: float, name: str) -> int:
    return by_name[name].in_flight(now)


def _prefix(
    by_name: dict[str, _Engine], fleet: Sequence[_Engine], hashes: list[BlockHash], name: str
) -> list[Tier]:
    engine = by_name[name]
    resident = engine.ledger.resident

    def tier_of(h: BlockHash) -> Tier | None:
        if engine.in_pool(h):
            return Tier.GPU
        for medium, tier in _TIER_OF_MEDIUM.items():
            if h in resident.get(medium, ()):
                return tier
        if any(h in e.ledger.resident.get("remote", ()) for e in fleet):
            return Tier.SHARED
        return None

    return prefix_tiers_by(hashes, tier_of)


def _figures(engine: _Engine) -> EngineFigures:
    ledger = engine.ledger
    return EngineFigures(
        engine.name,
        engine.requests,
        engine.block_refs,
        ledger.prefix_hits,
        ledger.hit_tokens,
        ledger.prefill_tokens_saved,
        {name: t.hit_blocks for name, t in ledger.tiers.items()},
        engine.workers,
    )
