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
from typing import TYPE_CHECKING

from kvtier.connector import Admission, OffloadConnector, TransferJob
from kvtier.request import Request
from kvtier.sim.concurrency import TimeModel
from kvtier.sim.dataplane import DataPlane, small_layout
from kvtier.sim.metrics import ReplayResult, TierCounters
from kvtier.sim.workload import Workload
from kvtier.types import BlockHash

if TYPE_CHECKING:
    from kvtier.sim.replay import Progress, ReplayConfig


@dataclass
class _Tally:
    gpu: TierCounters
    cpu: TierCounters
    cpu_resident: set[BlockHash] = field(default_factory=set)
    any_hits: int = 0
    unschedulable: int = 0
    waited: int = 0
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
    from kvtier.sim.tiers import build_tiers

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
    if config.data:
        tally.dp = DataPlane(small_layout(bs), config.gpu_blocks, max(1, capacity))
    started = time.perf_counter()
    try:
        if config.time_model is None:
            _sequential(workload, connector, tally, progress)
        else:
            _concurrent(workload, connector, tally, config.time_model)
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
        extra={"unschedulable_requests": tally.unschedulable, "waited": tally.waited},
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
    job = connector.computed(request)
    if job is not None or connector.store_on == "compute":
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
        if progress is not None and i % 512 == 0:
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


def _concurrent(
    workload: Workload, connector: OffloadConnector, tally: _Tally, model: TimeModel
) -> None:
    """Event loop on virtual time: arrivals, prefill ends (loads/stores), decode ends."""
    bs = workload.block_size
    events: list[tuple[float, int, Request, Admission | None]] = []
    waiting: deque[Request] = deque()
    output_of: dict[str, int] = {}
    hashes_of: dict[str, list[BlockHash]] = {}
    seq = itertools.count()
    running = 0

    def start(now: float, request: Request) -> bool:
        nonlocal running
        present = _present(connector, tally, hashes_of[request.request_id])
        adm = connector.admit(request)
        if adm is None:
            return False
        running += 1
        tally.any_hits += present
        tally.admitted(adm, request, bs)
        for job in adm.stores:
            _store(connector, tally, job)
        cached = (adm.gpu_hit_blocks + adm.offload_hit_blocks) * bs
        done = now + model.prefill_ms(request.num_tokens - cached, adm.offload_hit_blocks)
        heapq.heappush(events, (done, next(seq), request, adm))
        return True

    def drain(now: float) -> None:
        """Start waiting requests in order; one that cannot fit an idle pool is dropped."""
        while waiting:
            if start(now, waiting[0]):
                waiting.popleft()
            elif running == 0:
                waiting.popleft()
                tally.unschedulable += 1
            else:
                break

    def handle(now: float, request: Request, adm: Admission | None) -> None:
        nonlocal running
        if adm is not None:  # prefill ended: loads done, computed blocks stored
            if adm.load is not None:
                connector.finish_load(adm.load)
            _store_computed(connector, tally, request, adm)
            decode = model.decode_ms(output_of[request.request_id])
            heapq.heappush(events, (now + decode, next(seq), request, None))
            return
        connector.finish(request)  # decode ended
        running -= 1
        drain(now)

    for i, request, hs in _requests(workload):
        now = workload.requests[i].timestamp
        while events and events[0][0] <= now:
            t, _, req, adm = heapq.heappop(events)
            handle(t, req, adm)
        if request is None:
            continue
        output_of[request.request_id] = workload.requests[i].output_length
        hashes_of[request.request_id] = hs
        waiting.append(request)
        drain(now)
        if waiting and waiting[-1] is request:
            tally.waited += 1
    while events:
        t, _, req, adm = heapq.heappop(events)
        handle(t, req, adm)
