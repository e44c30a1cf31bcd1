"""The scheduler-side connector: glue between the accelerator pool and an offload tier.

An engine embeds one `OffloadConnector` and calls it at four moments of a request's
life, mirroring vLLM's offloading connector (scheduler half):

1. `admit(request)` when the scheduler wants to start it: the accelerator prefix
   hit (`get_computed_blocks`), then the offload tier continues that prefix
   (`lookup`, capped so the last prompt token is always computed), then slots are
   allocated for everything past the accelerator hit. The offloaded blocks are
   pinned (`prepare_load`) and returned as a load job aimed at their new slots.
   None means "no room now" and nothing changed (beyond lookup statistics).
2. `computed(request)` once its prefill ran: the newly computed full blocks are
   planned as a store job (`store_on="compute"`, vLLM's behaviour). With
   `store_on="evict"` blocks go to the tier only when the accelerator evicts them
   (fewer stores for prefixes that stay hot; the eviction hook queues them).
3. `finish_load(job, ok)` / `finish_store(job, ok)` as transfers complete: a
   failed load is a miss the engine recomputes; a failed store frees its slots.
4. `finish(request)` or `preempt(request)`: free the accelerator blocks.

No bytes move here: jobs carry hashes, accelerator block ids and the tier's spec,
and a data plane (or the replay, which completes them on its own clock) runs them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtier.gpu.block_pool import EvictionHook
from kvtier.gpu.manager import KVCacheManager
from kvtier.offload.abstract import LoadStoreSpec, OffloadingManager
from kvtier.request import Request
from kvtier.types import BlockHash

StoreOn = Literal["compute", "evict"]


@dataclass(frozen=True)
class TransferJob:
    job_id: int
    kind: Literal["load", "store"]
    request_id: str | None  # None for stores of evicted blocks (no request owns them)
    block_hashes: list[BlockHash]
    gpu_block_ids: list[int]
    spec: LoadStoreSpec
    # For stores: the tier's victims that made room (already gone from the tier).
    evicted: list[BlockHash] = field(default_factory=list)


@dataclass(frozen=True)
class Admission:
    gpu_hit_blocks: int
    offload_hit_blocks: int
    load: TransferJob | None
    # Stores of blocks the accelerator evicted while making room (store_on="evict").
    stores: list[TransferJob] = field(default_factory=list)


@dataclass
class ConnectorCounters:
    admitted: int = 0
    refused: int = 0
    stores_planned: int = 0
    store_rejections: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    gpu_evictions: int = 0


class OffloadConnector:
    def __init__(
        self, gpu: KVCacheManager, offload: OffloadingManager, *, store_on: StoreOn = "compute"
    ) -> None:
        """Prefer `OffloadConnector.create`: store-on-eviction needs the pool's hook."""
        if store_on not in ("compute", "evict"):
            raise ValueError(f"store_on must be 'compute' or 'evict', got {store_on!r}")
        self.gpu = gpu
        self.offload = offload
        self.store_on: StoreOn = store_on
        self.block_size = gpu.block_size
        self.counters = ConnectorCounters()
        self._job_ids = itertools.count()
        self._first_computed: dict[str, int] = {}  # request -> first block its prefill made
        self._loads: dict[int, TransferJob] = {}
        self._stores: dict[int, TransferJob] = {}
        self._evicted: list[BlockHash] = []

    @classmethod
    def create(
        cls,
        offload: OffloadingManager,
        *,
        block_size: int,
        num_gpu_blocks: int,
        max_model_len: int,
        store_on: StoreOn = "compute",
        num_preallocate_tokens: int = 0,
    ) -> OffloadConnector:
        """An accelerator pool wired to the connector (its eviction hook included)."""
        hook: list[EvictionHook] = []
        gpu = KVCacheManager(
            block_size,
            num_gpu_blocks,
            max_model_len,
            num_preallocate_tokens=num_preallocate_tokens,
            log_stats=False,
            on_evict=lambda block_hash: hook[0](block_hash),
        )
        connector = cls(gpu, offload, store_on=store_on)
        hook.append(connector.on_gpu_evict)
        return connector

    def on_gpu_evict(self, block_hash: BlockHash) -> None:
        """The pool's eviction hook: count, and queue the block when storing on eviction."""
        self.counters.gpu_evictions += 1
        if self.store_on == "evict":
            self._evicted.append(block_hash)

    # --- 1. admission ---------------------------------------------------------------

    def admit(self, request: Request) -> Admission | None:
        """Accelerator hit, offload continuation, allocation, load plan; None: no room."""
        blocks, gpu_tokens = self.gpu.get_computed_blocks(request)
        hashes = request.get_block_hashes(self.block_size, self.gpu.hash_algorithm)
        start = len(blocks)
        limit = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        ext = (self.offload.lookup(hashes[start:limit]) or 0) if start < limit else 0
        if self.gpu.allocate_slots(request, request.num_tokens - gpu_tokens, blocks) is None:
            self.counters.refused += 1
            return None
        self.counters.admitted += 1
        load = None
        if ext:
            loaded = list(hashes[start : start + ext])
            spec = self.offload.prepare_load(loaded)
            ids = self.gpu.get_block_ids(request.request_id)[start : start + ext]
            load = TransferJob(next(self._job_ids), "load", request.request_id, loaded, ids, spec)
            self._loads[load.job_id] = load
        self.offload.touch(hashes)
        self._first_computed[request.request_id] = start + ext
        return Admission(start, ext, load, self._store_evicted())

    # --- 2. stores ------------------------------------------------------------------

    def computed(self, request: Request) -> TransferJob | None:
        """The store job for blocks this request's prefill computed (store_on='compute')."""
        first = self._first_computed.pop(request.request_id, None)
        if first is None:
            raise KeyError(f"request {request.request_id!r} was not admitted (or already stored)")
        if self.store_on != "compute":
            return None
        hashes = request.get_block_hashes(self.block_size, self.gpu.hash_algorithm)
        num_full = min(len(hashes), request.num_prompt_tokens // self.block_size)
        if first >= num_full:
            return None
        ids = self.gpu.get_block_ids(request.request_id)
        return self._plan_store(request.request_id, hashes[first:num_full], ids, first)

    def _store_evicted(self) -> list[TransferJob]:
        if not self._evicted:
            return []
        hashes = list(dict.fromkeys(self._evicted))
        self._evicted.clear()
        job = self._plan_store(None, hashes, [], 0)
        return [job] if job is not None else []

    def _plan_store(
        self, request_id: str | None, hashes: Sequence[BlockHash], ids: list[int], first: int
    ) -> TransferJob | None:
        out = self.offload.prepare_store(hashes)
        if out is None:
            self.counters.store_rejections += 1
            return None
        to_store = out.block_hashes_to_store
        if not to_store and not out.block_hashes_evicted:
            return None
        if ids:  # the slots of the hashes actually stored, by their position
            position = {h: first + i for i, h in enumerate(hashes)}
            ids = [ids[position[h]] for h in to_store]
        job = TransferJob(
            next(self._job_ids),
            "store",
            request_id,
            to_store,
            ids,
            out.store_spec,
            out.block_hashes_evicted,
        )
        self._stores[job.job_id] = job
        self.counters.stores_planned += len(to_store)
        return job

    # --- 3. completions -------------------------------------------------------------

    def finish_load(self, job: TransferJob, ok: bool = True) -> None:
        """Unpin the loaded blocks; a failed load means the engine recomputes them."""
        if self._loads.pop(job.job_id, None) is None:
            raise KeyError(f"load job {job.job_id} is unknown or already finished")
        self.offload.complete_load(job.block_hashes)
        if not ok:
            self.counters.failed_loads += 1

    def finish_store(self, job: TransferJob, ok: bool = True) -> None:
        if self._stores.pop(job.job_id, None) is None:
            raise KeyError(f"store job {job.job_id} is unknown or already finished")
        self.offload.complete_store(job.block_hashes, success=ok)
        if not ok:
            self.counters.failed_stores += 1

    # --- 4. release -----------------------------------------------------------------

    def finish(self, request: Request) -> None:
        """Free the request's accelerator blocks (tail first: its end is evicted first)."""
        self._first_computed.pop(request.request_id, None)
        self.gpu.free(request)

    def preempt(self, request: Request) -> None:
        """Free a running request to make room; it will be admitted again later."""
        self._first_computed.pop(request.request_id, None)
        self.gpu.preempt(request)

    @property
    def jobs_in_flight(self) -> int:
        return len(self._loads) + len(self._stores)
