"""The replay with an accelerator tier: requests go through the connector.

Each request is built from its trace hashes (only FULL blocks have one, as in the
engine), admitted (accelerator hit, then the offload tier continues the prefix),
its loads completed, its computed blocks stored, then it finishes. With a time
model, requests overlap: each holds its accelerator blocks from admission until
its decode ends, loads and stores stay in flight for the length of its prefill, and
requests that find no room wait in arrival order (head of line) for one to finish.

Hit rates keep the trace's denominator (all block references, partial last blocks
included) so they compare with the offload-only replay and the bounds.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from kvtier.connector import Admission, OffloadConnector, TransferJob
from kvtier.request import Request
from kvtier.sim.concurrency import TimeModel
from kvtier.sim.dataplane import DataPlane, small_layout
from kvtier.sim.metrics import ReplayResult, TierCounters
from kvtier.sim.replay import PROGRESS_EVERY, Progress, ReplayConfig
from kvtier.sim.tiers import OffloadTiers, build_tiers
from kvtier.sim.workload import Workload
from kvtier.types import BlockHash


@dataclass
class _Tally:
    gpu: TierCounters
    cpu: TierCounters
    cpu_resident: set[BlockHash] = field(default_factory=set)
    any_hits: int = 0
    unschedulable: int = 0
    waited: int = 0
    # accelerator-evicted blocks the offload tier refused (store_on="evict"): lost
    evicted_blocks_dropped: int = 0
    dp: DataPlane | None = None

    def admitted(self, adm: Admission, request: Request, bs: int) -> None:
        self.gpu.hit_blocks += adm.gpu_hit_blocks
        self.gpu.hit_tokens += adm.gpu_hit_blocks * bs
        self.cpu.hit_blocks += adm.offload_hit_blocks
        self.cpu.hit_tokens += adm.offload_hit_blocks * bs
        self.gpu.stores += request.num_prompt_tokens // bs - adm.gpu_hit_blocks


def replay_with_connector(
    workload: Workload, config: ReplayConfig, progress: Progress | None = None
) -> ReplayResult:
    bs = workload.block_size
    tiers = build_tiers(workload, config)
    capacity = tiers.cpu_capacity
    offload = tiers.manager
    longest = max((r.input_length + r.output_length for r in workload.requests), default=1)
    connector = OffloadConnector.create(
        offload,
        block_size=bs,
        num_gpu_blocks=config.gpu_blocks,
        max_model_len=longest + 1,
        store_on=config.store_on,
    )
    tally = _Tally(
        TierCounters("gpu", config.gpu_blocks, "lru"),
        TierCounters("cpu", capacity, config.policy),
    )
    return _run(workload, config, connector, tally, tiers, progress)


def _run(
    workload: Workload,
    config: ReplayConfig,
    connector: OffloadConnector,
    tally: _Tally,
    tiers: OffloadTiers,
    progress: Progress | None,
) -> ReplayResult:
    bs, capacity = workload.block_size, tiers.cpu_capacity
    try:
        if config.data:
            tally.dp = DataPlane(small_layout(bs), config.gpu_blocks, max(1, capacity))
        started = time.perf_counter()
        if config.time_model is None:
            _sequential(workload, connector, tally, progress)
        else:
            _EventLoop(workload, connector, tally, config.time_model).run()
    finally:
        tiers.close()
        if tally.dp is not None:
            tally.dp.close()
            tally.cpu.bytes_stored = tally.dp.bytes_stored
            tally.cpu.bytes_loaded = tally.dp.bytes_loaded
            tally.cpu.checksum_failures = tally.dp.checksum_failures
    seconds = time.perf_counter() - started
    tally.gpu.evictions = connector.counters.gpu_evictions
    tally.cpu.store_rejections = connector.counters.store_rejections
    tally.evicted_blocks_dropped = connector.counters.evicted_blocks_dropped
    return _result(workload, config, tally, tiers, seconds)


def _result(
    workload: Workload, config: ReplayConfig, tally: _Tally, tiers: OffloadTiers, seconds: float
) -> ReplayResult:
    bs = workload.block_size
    prefix = tally.gpu.hit_blocks + tally.cpu.hit_blocks
    return ReplayResult(
        policy=config.policy,
        block_refs=workload.block_refs,
        input_tokens=workload.input_tokens,
        any_hit_blocks=tally.any_hits,
        prefix_hit_blocks=prefix,
        hit_tokens=prefix * bs,
        prefill_tokens_saved=prefix * bs,  # the connector already kept the last token
        tiers=(
            tally.gpu.freeze(workload.block_refs),
            *tiers.stats(tally.cpu, workload.block_refs, bs),
        ),
        seconds=seconds,
        extra={
            "unschedulable_requests": tally.unschedulable,
            "waited": tally.waited,
            "evicted_blocks_dropped": tally.evicted_blocks_dropped,
        },
    )


def _requests(workload: Workload) -> list[tuple[int, Request | None, list[BlockHash]]]:
    bs = workload.block_size
    out: list[tuple[int, Request | None, list[BlockHash]]] = []
    for i, (r, hs) in enumerate(zip(workload.requests, workload.block_hashes, strict=True)):
        full = min(len(hs), r.input_length // bs)
        req = (
            Request.from_block_hashes(f"r{i}", hs[:full], r.input_length, block_size=bs)
            if r.input_length
            else None
        )
        out.append((i, req, hs))
    return out


def _present(connector: OffloadConnector, tally: _Tally, hs: list[BlockHash]) -> int:
    """Blocks of the request held by some tier, at any position (counted at admission)."""
    is_cached, resident = connector.gpu.is_cached, tally.cpu_resident
    return sum(1 for h in hs if h in resident or is_cached(h))


def _store(connector: OffloadConnector, tally: _Tally, job: TransferJob | None) -> None:
    if job is None:
        return
    ok = tally.dp.store(job.gpu_block_ids, job.spec) if tally.dp is not None else True
    connector.finish_store(job, ok)
    tally.cpu_resident.difference_update(job.evicted)
    tally.cpu.evictions += len(job.evicted)
    if ok:
        tally.cpu.stores += len(job.block_hashes)
        tally.cpu_resident.update(job.block_hashes)


def _store_computed(
    connector: OffloadConnector, tally: _Tally, request: Request, adm: Admission
) -> None:
    """Store what the prefill computed; offered blocks absent but not stored were filtered."""
    hashes = request.get_block_hashes(connector.block_size, connector.gpu.hash_algorithm)
    first = adm.gpu_hit_blocks + adm.offload_hit_blocks
    offered = sum(1 for h in hashes[first:] if h not in tally.cpu_resident)
    rejections = connector.counters.store_rejections
    job = connector.computed(request)
    refused = connector.counters.store_rejections > rejections  # the tier had no room
    if connector.store_on == "compute" and not refused:
        tally.cpu.filtered_stores += offered - (len(job.block_hashes) if job else 0)
    _store(connector, tally, job)


def _move_bytes(
    connector: OffloadConnector, dp: DataPlane, request: Request, adm: Admission
) -> Admission:
    """Verify the GPU hits, run the load (a failed one is recomputed), compute the rest."""
    hashes = request.get_block_hashes(connector.block_size, connector.gpu.hash_algorithm)
    ids = connector.gpu.get_block_ids(request.request_id)
    gpu_hit = adm.gpu_hit_blocks
    dp.verify(ids[:gpu_hit], hashes[:gpu_hit])
    ext = adm.offload_hit_blocks
    if adm.load is not None:
        ok = dp.load(adm.load.spec, adm.load.gpu_block_ids, adm.load.block_hashes)
        connector.finish_load(adm.load, ok)
        if not ok:
            ext = 0
    full = request.num_prompt_tokens // connector.block_size
    dp.compute(ids[gpu_hit + ext : full], hashes[gpu_hit + ext : full])
    return dataclasses.replace(adm, offload_hit_blocks=ext)


def _sequential(
    workload: Workload, connector: OffloadConnector, tally: _Tally, progress: Progress | None
) -> None:
    bs = workload.block_size
    for i, request, hs in _requests(workload):
        if progress is not None and i % PROGRESS_EVERY == 0:
            progress(i)
        if request is None:
            continue
        present = _present(connector, tally, hs)
        adm = connector.admit(request)
        if adm is None:
            tally.unschedulable += 1  # larger than the whole accelerator pool
            continue
        tally.any_hits += present
        if tally.dp is not None:
            adm = _move_bytes(connector, tally.dp, request, adm)
        elif adm.load is not None:
            connector.finish_load(adm.load)
        tally.admitted(adm, request, bs)
        for job in adm.stores:
            _store(connector, tally, job)
        _store_computed(connector, tally, request, adm)
        connector.finish(request)
    if progress is not None:
        progress(len(workload.requests))


class _EventLoop:
    """Virtual time: arrivals, prefill ends (loads done, stores planned), decode ends.

    Requests that find no room wait in arrival order (head of line); one that cannot
    fit even an idle pool is dropped and counted as unschedulable.
    """

    def __init__(
        self, workload: Workload, connector: OffloadConnector, tally: _Tally, model: TimeModel
    ) -> None:
        self.w, self.c, self.tally, self.model = workload, connector, tally, model
        self.events: list[tuple[float, int, Request, Admission | None]] = []
        self.waiting: deque[Request] = deque()
        self.index_of: dict[str, int] = {}
        self.seq = itertools.count()
        self.running = 0

    def run(self) -> None:
        for i, request, _ in _requests(self.w):
            self.advance(self.w.requests[i].timestamp)
            if request is None:
                continue
            self.index_of[request.request_id] = i
            self.waiting.append(request)
            self.drain(self.w.requests[i].timestamp)
            if self.waiting and self.waiting[-1] is request:
                self.tally.waited += 1
        self.advance(float("inf"))

    def advance(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            now, _, request, adm = heapq.heappop(self.events)
            self.handle(now, request, adm)

    def start(self, now: float, request: Request) -> bool:
        i = self.index_of[request.request_id]
        present = _present(self.c, self.tally, self.w.block_hashes[i])
        adm = self.c.admit(request)
        if adm is None:
            return False
        self.running += 1
        self.tally.any_hits += present
        self.tally.admitted(adm, request, self.w.block_size)
        for job in adm.stores:
            _store(self.c, self.tally, job)
        cached = (adm.gpu_hit_blocks + adm.offload_hit_blocks) * self.w.block_size
        done = now + self.model.prefill_ms(request.num_tokens - cached, adm.offload_hit_blocks)
        heapq.heappush(self.events, (done, next(self.seq), request, adm))
        return True

    def drain(self, now: float) -> None:
        while self.waiting:
            if self.start(now, self.waiting[0]):
                self.waiting.popleft()
            elif self.running == 0:
                self.waiting.popleft()
                self.tally.unschedulable += 1
            else:
                break

    def handle(self, now: float, request: Request, adm: Admission | None) -> None:
        if adm is not None:  # prefill ended: loads done, computed blocks stored
            if adm.load is not None:
                self.c.finish_load(adm.load)
            _store_computed(self.c, self.tally, request, adm)
            output = self.w.requests[self.index_of[request.request_id]].output_length
            done = now + self.model.decode_ms(output)
            heapq.heappush(self.events, (done, next(self.seq), request, None))
            return
        self.c.finish(request)  # decode ended
        self.running -= 1
        self.drain(now)
