"""The replay predicts the engine: the same trace, through vLLM's scheduler side and through
`kvtier replay`, gives the same figures per tier.

The engine side is kvtier's spec as vLLM builds it (`KvtierOffloadingSpec.get_manager`)
driven with vLLM's `OffloadingManager` calls in the order its offloading connector makes
them for one request at a time: a lookup per block key until the first miss (asking
again while Redis answers "retry"), the load of the hit run and its completion, then
the store of the blocks it computed and its completion, and the request's end (vLLM
0.32 never calls `touch`). Per
tier the figures are counted as the replay counts them: hits from where each loaded
block came, stores and evictions from the events vLLM is given, and filtered blocks as
the computed blocks that were in no tier and were not taken.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvtier.sim.bytes_plane import position_tiers
from kvtier.sim.generator import GeneratorConfig, generate_workload
from kvtier.sim.replay_config import ReplayConfig
from kvtier.sim.run import replay
from kvtier.sim.workload import Workload
from kvtier.store.diskformat import block_file_bytes
from tests.remote.conftest import RedisServer, serve_redis
from tests.vllm.needs_vllm import quiet, require_vllm
from tests.vllm.offloading_config import offloading_config

require_vllm()

with quiet():
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        Locality,
        LookupResult,
        Medium,
        ReqContext,
        make_offload_key,
    )

    from kvtier.vllm.offloading.offloading_spec import UNDER_KVTIER_CONNECTOR, KvtierOffloadingSpec

LAYERS, PAGE = 2, 2048  # a layer's K and V of one block
BLOCK_BYTES = LAYERS * PAGE
CPU_BLOCKS, DISK_BLOCKS = 120, 400
# Generated chats, agents and documents sharing system prompts: reuse at every distance.
WORKLOAD = generate_workload(GeneratorConfig(num_requests=500), seed=3)


@dataclass
class Figures:
    hits: Counter[str] = field(default_factory=Counter)
    stores: Counter[str] = field(default_factory=Counter)
    evictions: Counter[str] = field(default_factory=Counter)
    filtered: int = 0


def _tier_of(medium: Medium, locality: Locality) -> str:
    if medium == Medium.CPU:
        return "cpu"
    return "remote" if locality == Locality.REMOTE else "disk"


class Worker:
    """The engine's worker, for the tiers whose blocks exist only once their bytes are
    written (Redis): device block `i` holds a request's block `i`."""

    def __init__(self, spec: KvtierOffloadingSpec, device_blocks: int) -> None:
        pages = [torch.zeros(device_blocks, PAGE, dtype=torch.int8) for _ in range(LAYERS)]
        caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, PAGE) for t in pages],
            [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
        )
        self.worker = spec.get_worker(caches)
        self.jobs = itertools.count()

    def run(self, is_load: bool, positions: list[int], spec: Any) -> None:
        job, device = next(self.jobs), GPULoadStoreSpec(positions, [len(positions)], [0])
        if is_load:
            self.worker.submit_load(job, spec, device)
        else:
            self.worker.submit_store(job, device, spec)
        self.worker.wait_finished({job})
        (result,) = [r for r in self.worker.get_finished() if r.job_id == job]
        assert result.success and not self.worker.take_report()

    def close(self) -> None:
        self.worker.shutdown()


def engine_figures(workload: Workload, extra: dict[str, Any], with_worker: bool = False) -> Figures:
    extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm"} | extra

    def spec() -> KvtierOffloadingSpec:
        config = offloading_config(
            extra,
            kv_bytes_per_block=BLOCK_BYTES,
            num_layers=LAYERS,
            tokens_per_block=workload.block_size,
            events=True,
        )
        return KvtierOffloadingSpec(config)

    token = UNDER_KVTIER_CONNECTOR.set(True)
    try:
        longest = max(len(hashes) for hashes in workload.block_hashes)
        worker = Worker(spec(), longest) if with_worker else None
        manager = spec().get_manager()
    finally:
        UNDER_KVTIER_CONNECTOR.reset(token)
    figures, resident = Figures(), Counter[bytes]()  # key -> tiers holding it

    def take_events() -> None:
        for event in manager.take_events():
            tier = _tier_of(event.medium, event.locality)
            for key in event.keys:
                resident[key] += -1 if event.removed else 1
            (figures.evictions if event.removed else figures.stores)[tier] += len(event.keys)

    try:
        for index, hashes in enumerate(workload.block_hashes):
            ctx = ReqContext(req_id=str(index))
            keys = [make_offload_key(h, 0) for h in hashes]
            hit = 0
            for key in keys:
                answer = manager.lookup(key, ctx)
                if answer is LookupResult.RETRY:  # Redis answers on a later step
                    assert manager.remote.wait_lookups(timeout=30)
                    answer = manager.lookup(key, ctx)
                if answer is not LookupResult.HIT:
                    break
                hit += 1
            if hit:
                load = manager.prepare_load(keys[:hit], ctx)
                for part in load.parts:
                    figures.hits.update(position_tiers(part.spec, len(part.block_hashes)))
            if hit:
                if worker is not None:
                    worker.run(True, list(range(hit)), load)
                manager.complete_load(set(keys[:hit]), ctx)
            take_events()
            rest = keys[hit:]
            if rest:
                absent = [k for k in rest if resident[k] <= 0]
                out = manager.prepare_store(rest, ctx)
                if out is not None:
                    taken = set(out.keys_to_store)
                    figures.filtered += sum(1 for k in absent if k not in taken)
                    if worker is not None and out.keys_to_store:
                        positions = [hit + rest.index(k) for k in out.keys_to_store]
                        worker.run(False, positions, out.store_spec)
                    manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
            take_events()
    finally:
        manager.shutdown()
        if worker is not None:
            worker.close()
    return figures


def replay_figures(workload: Workload, config: ReplayConfig) -> Figures:
    result = replay(workload, config)
    figures = Figures(filtered=sum(t.filtered_stores for t in result.tiers))
    for t in result.tiers:
        figures.hits[t.name] += t.hit_blocks
        figures.stores[t.name] += t.stores
        figures.evictions[t.name] += t.evictions
    return figures


def _drop_zeros(figures: Figures) -> Figures:
    for counter in (figures.hits, figures.stores, figures.evictions):
        for name in [n for n, v in counter.items() if not v]:
            del counter[name]
    return figures


LOCAL_STACKS = {
    "cpu": ({}, {}),
    "cpu+filter": ({"store_threshold": 2}, {"store_threshold": 2}),
    "cpu+disk demote": ({"disk_writes": "demote"}, {"disk_writes": "demote"}),
    "cpu+disk write_through": ({"disk_writes": "write_through"}, {"disk_writes": "write_through"}),
    "cpu+disk+filter": (
        {"store_threshold": 3, "disk_writes": "demote"},
        {"store_threshold": 3, "disk_writes": "demote"},
    ),
}


@pytest.mark.parametrize("stack", sorted(LOCAL_STACKS))
def test_the_replay_counts_what_the_engine_does(stack: str, tmp_path: Path) -> None:
    extra, replay_args = LOCAL_STACKS[stack]
    extra = {"cpu_bytes_to_use": CPU_BLOCKS * BLOCK_BYTES} | extra
    replay_args = {"cpu_blocks": CPU_BLOCKS} | replay_args
    if "disk" in stack:
        extra |= {
            "disk_path": str(tmp_path),
            "disk_bytes_to_use": DISK_BLOCKS * block_file_bytes(BLOCK_BYTES),
        }
        replay_args |= {"disk_blocks": DISK_BLOCKS}
    engine = _drop_zeros(engine_figures(WORKLOAD, extra))
    predicted = _drop_zeros(replay_figures(WORKLOAD, ReplayConfig("lru", **replay_args)))
    assert engine == predicted
    assert engine.hits["cpu"] > 0 and engine.evictions["cpu"] > 0  # the tiers were pressed
    if "disk" in stack:
        assert engine.hits["disk"] > 0
    if "filter" in stack:
        assert engine.filtered > 0


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from serve_redis(tmp_path)


def test_the_replay_counts_what_the_engine_does_with_redis(redis_server: RedisServer) -> None:
    extra = {"cpu_bytes_to_use": CPU_BLOCKS * BLOCK_BYTES, "redis_url": redis_server.url}
    engine = _drop_zeros(engine_figures(WORKLOAD, extra, with_worker=True))
    config = ReplayConfig("lru", cpu_blocks=CPU_BLOCKS, redis_url=redis_server.url)
    predicted = _drop_zeros(replay_figures(WORKLOAD, config))
    assert engine == predicted
    assert engine.hits["remote"] > 0 and engine.stores["remote"] > 0
