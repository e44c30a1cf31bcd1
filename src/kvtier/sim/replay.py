"""The replay: drive the offload stack from a workload the way an engine would.

With no accelerator tier (`gpu_blocks=0`) each request is, for the offload tier:
lookup -> load the hits -> touch all -> store the rest -> complete. That loop is
kept lean (hashes packed once per workload, no per-block objects, bound methods
hoisted) because it is also the throughput benchmark of the managers underneath.
With an accelerator tier the requests go through the connector instead
(`kvtier.connector`), exactly as an engine's scheduler would drive it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvtier.offload.abstract import OffloadingManager
from kvtier.sim.concurrency import TimeModel, concurrent_offload_loop
from kvtier.sim.metrics import ReplayResult, TierCounters, served_tokens
from kvtier.sim.workload import Workload
from kvtier.types import BlockHash

Progress = Callable[[int], None]
StoreOn = Literal["compute", "evict"]
# Requests between two progress callbacks: often enough for a smooth bar, rare
# enough to cost nothing in the loop.
PROGRESS_EVERY = 512


@dataclass(frozen=True)
class ReplayConfig:
    """One replay: tiers, their capacities and policy, and the admission filter."""

    policy: str = "lru"
    # CPU tier size in blocks, or as a fraction of the trace's unique blocks.
    cpu_blocks: int | None = None
    cpu_frac: float | None = None
    gpu_blocks: int = 0
    # Reuse filter: store a block only once seen this many times (0: no filter).
    store_threshold: int = 0
    # Overlap requests by arrival time (in-flight loads/stores); None: sequential.
    time_model: TimeModel | None = None
    # With an accelerator tier: store blocks to the CPU tier once computed (vLLM)
    # or only when the accelerator evicts them.
    store_on: StoreOn = "compute"
    # A local disk tier below the CPU tier (the cascade: demotion on CPU eviction).
    disk_blocks: int = 0
    # A shared Redis tier below the CPU tier (write-through, promotion on load).
    redis_url: str | None = None
    # Key namespace in Redis; None: a fresh one per replay (runs never share blocks).
    redis_namespace: str | None = None
    # Move real bytes through the data plane (CPU tier) and verify every load.
    data: bool = False
    # Placeholder bytes written per block without a data plane (Redis memory and
    # traffic then behave as with real blocks of that size).
    remote_payload_bytes: int = 256

    def __post_init__(self) -> None:
        if self.cpu_blocks is not None and self.cpu_frac is not None:
            raise ValueError("give cpu_blocks or cpu_frac, not both")
        if self.cpu_blocks is not None and self.cpu_blocks < 0:
            raise ValueError(f"cpu_blocks must be >= 0, got {self.cpu_blocks}")
        if self.cpu_frac is not None and not 0 < self.cpu_frac <= 1:
            raise ValueError(f"cpu_frac must be in (0, 1], got {self.cpu_frac}")
        if self.store_on not in ("compute", "evict"):
            raise ValueError(f"store_on must be 'compute' or 'evict', got {self.store_on!r}")
        extra_tiers = bool(self.disk_blocks) + bool(self.redis_url)
        if self.data and (self.time_model or extra_tiers > 1 or (extra_tiers and self.gpu_blocks)):
            raise ValueError(
                "data=True moves bytes in a sequential replay through the CPU tier (with a "
                "GPU tier), or through CPU+disk or CPU+Redis (without one); other "
                "combinations and the concurrency model run bookkeeping-only"
            )
        if self.data and self.store_on == "evict":
            raise ValueError("data=True needs store_on='compute' (evicted blocks' bytes are gone)")
        if self.disk_blocks < 0:
            raise ValueError(f"disk_blocks must be >= 0, got {self.disk_blocks}")
        if self.gpu_blocks < 0:
            raise ValueError(f"gpu_blocks must be >= 0, got {self.gpu_blocks}")
        if self.store_threshold != 0 and self.store_threshold < 2:
            raise ValueError(
                f"store_threshold must be 0 (no filter) or >= 2, got {self.store_threshold}"
            )

    def cpu_capacity(self, workload: Workload) -> int:
        """Blocks in the CPU tier; the default is 5% of the unique blocks."""
        if self.cpu_blocks is not None:
            return self.cpu_blocks
        frac = 0.05 if self.cpu_frac is None else self.cpu_frac
        return max(1, int(workload.unique_blocks * frac))

    def total_capacity(self, workload: Workload) -> int:
        """Blocks all tiers hold together; a remote tier is unbounded (Redis evicts)."""
        remote = workload.unique_blocks if self.redis_url else 0
        return self.gpu_blocks + self.cpu_capacity(workload) + self.disk_blocks + remote


def replay(
    workload: Workload, config: ReplayConfig, progress: Progress | None = None
) -> ReplayResult:
    """Replay the workload once under `config` and measure every tier."""
    if config.gpu_blocks:
        from kvtier.sim.tiered import replay_with_connector

        return replay_with_connector(workload, config, progress)
    from kvtier.sim.tiers import build_tiers

    if config.data:
        return _replay_with_data(workload, config)
    tiers = build_tiers(workload, config)
    total = TierCounters("cpu", tiers.cpu_capacity, config.policy)
    # A bare CPU manager stores every absent block it is offered: its answers alone
    # say which blocks were present, no mirror needed (the fast path).
    plain = not (config.store_threshold or tiers.chain or tiers.local)
    try:
        result = replay_offload_only(
            workload, tiers.manager, total, progress, config.time_model, stores_all_absent=plain
        )
    finally:
        tiers.close()
    per_tier = tiers.stats(total, workload.block_refs, workload.block_size)
    return dataclasses.replace(result, tiers=tuple(per_tier))


def _replay_with_data(workload: Workload, config: ReplayConfig) -> ReplayResult:
    """The offload-only replay with real bytes (CPU tier, or the CPU->disk cascade)."""
    from kvtier.sim.dataplane import DataPlane, data_offload_loop, small_layout
    from kvtier.sim.tiers import build_tiers

    longest = max((len(ids) for ids in workload.block_ids), default=1)
    capacity = config.cpu_capacity(workload)
    namespace = config.redis_namespace or f"replay-{uuid.uuid4().hex}"
    layout = small_layout(workload.block_size, model_id=f"kvtier-replay/{namespace}")
    with contextlib.ExitStack() as cleanup:  # closes the data plane first, then the tiers
        tiers = None
        if config.redis_url:
            tiers = build_tiers(workload, config, layout=layout)
            cleanup.callback(tiers.close)
        remote = tiers.remote if tiers is not None else None
        dp = DataPlane(layout, max(1, longest), max(1, capacity), config.disk_blocks, remote)
        cleanup.callback(dp.close)
        if tiers is None:
            tiers = build_tiers(workload, config, disk_store=dp.disk_store)
            cleanup.callback(tiers.close)
        total = TierCounters("cpu", capacity, config.policy)
        started = time.perf_counter()
        cascade = tiers.local.inner if tiers.local is not None else None
        tallies = data_offload_loop(workload, tiers.manager, total, dp, cascade)
        seconds = time.perf_counter() - started
    result = _result(workload, total, tallies, seconds)
    if tiers.local is None and tiers.chain is None:
        return result
    per_tier = []
    for t in tiers.stats(total, workload.block_refs, workload.block_size):
        stored, loaded = dp.moved[t.name, "stored"], dp.moved[t.name, "loaded"]
        failures = dp.failures(t.name)
        per_tier.append(
            dataclasses.replace(
                t, bytes_stored=stored, bytes_loaded=loaded, checksum_failures=failures
            )
        )
    return dataclasses.replace(result, tiers=tuple(per_tier))


def replay_offload_only(
    workload: Workload,
    manager: OffloadingManager,
    counters: TierCounters,
    progress: Progress | None = None,
    time_model: TimeModel | None = None,
    *,
    stores_all_absent: bool = False,
) -> ReplayResult:
    """lookup -> load hits -> touch all -> store the rest -> complete, per request.

    `stores_all_absent`: the manager's `prepare_store` takes every offered block it
    lacks (no admission filter, one tier), so blocks present at any position are
    counted from its answers instead of a mirror of its contents (faster; same figures).
    """
    hashes = workload.block_hashes
    started = time.perf_counter()
    if time_model is None:
        mirror = not stores_all_absent
        tallies = _offload_loop(workload, hashes, manager, counters, progress, mirror)
    else:
        tallies = concurrent_offload_loop(workload, manager, counters, time_model)
    return _result(workload, counters, tallies, time.perf_counter() - started)


def _result(
    workload: Workload,
    counters: TierCounters,
    tallies: tuple[int, int, int, int],
    seconds: float,
) -> ReplayResult:
    any_hits, prefix_hits, hit_tokens, saved = tallies
    counters.hit_blocks = prefix_hits
    counters.hit_tokens = hit_tokens
    return ReplayResult(
        policy=counters.policy,
        block_refs=workload.block_refs,
        input_tokens=workload.input_tokens,
        any_hit_blocks=any_hits,
        prefix_hit_blocks=prefix_hits,
        hit_tokens=hit_tokens,
        prefill_tokens_saved=saved,
        tiers=(counters.freeze(workload.block_refs),),
        seconds=seconds,
    )


def _offload_loop(
    workload: Workload,
    hashes: tuple[list[BlockHash], ...],
    manager: OffloadingManager,
    c: TierCounters,
    progress: Progress | None,
    mirror: bool,
) -> tuple[int, int, int, int]:
    # One function on purpose: this is the benchmarked hot loop (no calls to split it).
    lookup, prepare_load, complete_load = (
        manager.lookup,
        manager.prepare_load,
        manager.complete_load,
    )
    touch, prepare_store, complete_store = (
        manager.touch,
        manager.prepare_store,
        manager.complete_store,
    )
    bs = workload.block_size
    resident: set[BlockHash] = set()  # mirror of the tier's contents, for any-position hits
    any_hits = prefix_hits = hit_tokens = saved = 0
    stores = evictions = absent_offered = rejections = 0
    for i, (request, hs) in enumerate(zip(workload.requests, hashes, strict=True)):
        n = len(hs)
        hit = lookup(hs) or 0  # None ("ask again") is a miss for a synchronous replay
        if hit:
            loaded = hs[:hit]
            prepare_load(loaded)
            complete_load(loaded)
            prefix_hits += hit
            tokens, saved_tokens = served_tokens(hit, bs, request.input_length)
            hit_tokens += tokens
            saved += saved_tokens
        touch(hs)
        if hit < n:
            rest = hs[hit:]
            # The hit run is present; beyond it, the mirror says (lookups change nothing).
            present = hit + len(resident.intersection(rest)) if mirror else -1
            out = prepare_store(rest)
            if out is None:
                rejections += 1
                if present < 0:  # rare (a request larger than the tier): ask block by block
                    present = hit + sum(lookup([h]) or 0 for h in rest)
            else:
                stored, evicted = out.block_hashes_to_store, out.block_hashes_evicted
                complete_store(stored)
                stores += len(stored)
                evictions += len(evicted)
                if mirror:
                    absent_offered += n - present
                    resident.difference_update(evicted)
                    resident.update(stored)
                else:  # what it did not take, it had
                    present = n - len(stored)
                    absent_offered += len(stored)
        else:
            present = n
        any_hits += present
        if progress is not None and i % PROGRESS_EVERY == 0:
            progress(i)
    c.stores += stores
    c.evictions += evictions
    c.filtered_stores += absent_offered - stores  # offered, absent, yet not stored
    c.store_rejections += rejections
    if progress is not None:
        progress(len(hashes))
    return any_hits, prefix_hits, hit_tokens, saved
