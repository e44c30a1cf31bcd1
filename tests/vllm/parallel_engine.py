"""One tensor-parallel engine in process, for tests of KvtierOffloadingSpec's shapes: one
scheduler-side manager and one worker per rank, each rank with device blocks of its own
bytes (its shard), driven as vLLM's connector drives them (a job is done when every rank
finished it; the ranks' reports and load errors are summed).

`kv_heads`: the model's KV heads, as KvtierConnector tells the spec, with vLLM's
head-major page layout (`LBHNC`) and vLLM's map of each rank's page into the whole page:
the spec then keeps Redis blocks by KV head (`engine_shape.head_sharing`). A rank's page
is its heads' part of a `HEAD_PAGE`-byte-per-head page.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np

from tests.vllm.needs_vllm import quiet, require_vllm
from tests.vllm.offloading_config import offloading_config

require_vllm()

with quiet():
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        CanonicalPageMapping,
        CopyRun,
        GPULoadStoreSpec,
        LookupResult,
        ReqContext,
        make_offload_key,
    )

    from kvtier.remote.head_shard import HeadShard
    from kvtier.vllm.offloading.job_specs import WorkerReport
    from kvtier.vllm.offloading.kvtier_connector import worker_meta
    from kvtier.vllm.offloading.offloading_spec import (
        TOTAL_KV_HEADS,
        UNDER_KVTIER_CONNECTOR,
        KvtierOffloadingSpec,
    )

LAYERS, TOKENS, PAGE = 2, 32, 2048
HEAD_PAGE = 1024  # one KV head's part of a layer's page, with `kv_heads`
DEVICE_BLOCKS = 16
BLOCK_BYTES = LAYERS * PAGE
_engine_ids = itertools.count()


def config(extra: dict[str, Any], *, tp: int = 1, rank: int = 0, **shape: Any) -> Any:
    extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm"} | extra
    layout = shape.pop("kv_cache_layout", None)
    made = offloading_config(
        extra,
        kv_bytes_per_block=shape.pop("kv_bytes_per_block", BLOCK_BYTES),
        num_layers=LAYERS,
        tp=tp,
        rank=rank,
        **shape,
    )
    return dataclasses.replace(made, kv_cache_layout=layout)


def head_mapping(shard: HeadShard, page: int) -> CanonicalPageMapping:
    """vLLM's map of a head-major page into the whole page (`canonical_mapping`)."""
    shards = shard.total // shard.count
    place = shard.first // shard.count * page
    return CanonicalPageMapping(
        canonical_page_size_bytes=shards * page,
        local_page_size_bytes=page,
        runs=(CopyRun(0, place, page, 1, page, page),),
        num_writers=1,  # (kvtier's check reads the runs and sizes only)
        writer_index=0,
        parallelism_agnostic=True,
    )


class ParallelEngine:
    """One engine of `tp` workers (and `groups` KV-cache groups) sharing one manager."""

    def __init__(
        self, extra: dict[str, Any], tp: int = 2, groups: int = 1, kv_heads: int | None = None
    ) -> None:
        engine_id = f"shape-test-{next(_engine_ids)}"
        shards = [HeadShard.of_rank(kv_heads, tp, r) for r in range(tp)] if kv_heads else []
        page = shards[0].count * HEAD_PAGE if shards else PAGE
        shape: dict[str, Any] = {"groups": groups, "engine_id": engine_id}
        if kv_heads:
            shape |= {"kv_cache_layout": "LBHNC", "kv_bytes_per_block": LAYERS * page}
        token = UNDER_KVTIER_CONNECTOR.set(True)
        heads = TOTAL_KV_HEADS.set(kv_heads)
        try:
            specs = [KvtierOffloadingSpec(config(extra, tp=tp, rank=r, **shape)) for r in range(tp)]
            scheduler_spec = KvtierOffloadingSpec(config(extra, tp=tp, **shape))
        finally:
            TOTAL_KV_HEADS.reset(heads)
            UNDER_KVTIER_CONNECTOR.reset(token)
        self.page = page
        self.pages = [
            [torch.zeros(DEVICE_BLOCKS, page, dtype=torch.int8) for _ in range(LAYERS)]
            for _ in range(tp)
        ]
        self.workers = []
        for rank, (spec, pages) in enumerate(zip(specs, self.pages, strict=True)):
            mapping = head_mapping(shards[rank], page) if shards and tp > 1 else None
            refs = [CanonicalKVCacheRef(i, page, mapping) for i in range(LAYERS)]
            tensors = [CanonicalKVCacheTensor(t, page) for t in pages]
            self.workers.append(spec.get_worker(CanonicalKVCaches(tensors, [refs] * groups)))
        self.manager = scheduler_spec.get_manager()  # after the workers opened their disks
        self.jobs = itertools.count()
        self.ctx = ReqContext(req_id="r")

    def compute(self, device_ids: list[int], seed: int) -> list[dict[int, bytes]]:
        """Each rank's shard of these blocks: different bytes per rank."""
        for rank, pages in enumerate(self.pages):
            rng = np.random.default_rng([seed, rank])
            for page in pages:
                for i in device_ids:
                    page[i] = torch.from_numpy(rng.integers(-128, 128, self.page, dtype=np.int8))
        return [{i: self.shard(rank, i) for i in device_ids} for rank in range(len(self.pages))]

    def shard(self, rank: int, device_id: int) -> bytes:
        return b"".join(page[device_id].numpy().tobytes() for page in self.pages[rank])

    def _run(self, job: int) -> tuple[set[int], WorkerReport]:
        """Every rank's result of a job, summed as vLLM and KvtierConnector sum them."""
        merged: Any = None
        errors: set[int] = set()
        for worker in self.workers:
            worker.wait_finished({job})
            (result,) = [r for r in worker.get_finished() if r.job_id == job]
            assert result.success  # under KvtierConnector failures go to the report
            errors |= worker.take_load_errors()
            done = OffloadingWorkerMetadata()
            done.mark_completed(job)
            meta = worker_meta(done, worker.take_report())
            merged = meta if merged is None else merged.aggregate(meta)
        assert merged.completed_jobs == {job: len(self.workers)}
        if merged.report:
            self.manager.apply_worker_report(merged.report)
        report: WorkerReport = merged.report
        return errors, report

    def store(self, keys: list[bytes], device_ids: list[int]) -> WorkerReport:
        out = self.manager.prepare_store(keys, self.ctx)
        assert out is not None
        ids = [device_ids[keys.index(k)] for k in out.keys_to_store]
        job = next(self.jobs)
        for worker in self.workers:
            worker.submit_store(job, GPULoadStoreSpec(ids, [len(ids)], [0]), out.store_spec)
        _, report = self._run(job)
        self.manager.complete_store(out.keys_to_store, self.ctx)
        return report

    def hits(self, keys: list[bytes]) -> list[bool]:
        return [self.manager.lookup(k, self.ctx) is LookupResult.HIT for k in keys]

    def load(self, keys: list[bytes], device_ids: list[int]) -> tuple[set[int], WorkerReport]:
        spec = self.manager.prepare_load(keys, self.ctx)
        job = next(self.jobs)
        for worker in self.workers:
            worker.submit_load(job, spec, GPULoadStoreSpec(device_ids, [len(device_ids)], [0]))
        errors, report = self._run(job)
        self.manager.complete_load(set(keys), self.ctx)
        return errors, report

    def close(self) -> None:
        self.manager.shutdown()
        for worker in self.workers:
            worker.shutdown()


def keys_of(n: int, group: int = 0) -> list[bytes]:
    return [make_offload_key(i.to_bytes(32, "big"), group) for i in range(n)]
