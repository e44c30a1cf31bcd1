"""The scheduler-side connector: glue between the accelerator pool and an offload tier.

An engine embeds one `OffloadConnector` and calls it at four moments of a request's
life, mirroring vLLM's offloading connector (scheduler half):

1. `admit(request)` when the scheduler wants to start it: the accelerator prefix
   hit (`get_computed_blocks`), then the offload tier continues that prefix
   (`lookup`, capped so the last prompt token is always computed), then slots are
   allocated for everything past the accelerator hit, and the request's
   `num_computed_tokens` is advanced to the whole prompt (the connector plays the
   scheduler, which owns that counter). The offloaded blocks are
   pinned (`prepare_load`) and returned as a load job aimed at their new slots.
   None means "no room now" and nothing changed (beyond lookup statistics).
2. `computed(request)` once its prefill ran: the newly computed full blocks are
   planned as a store job (`store_on="compute"`, vLLM's behaviour). With
   `store_on="evict"` blocks go to the tier only when the accelerator evicts them
   (fewer stores for prefixes that stay hot; the eviction hook queues them).
3. `finish_load(job, ok)` / `finish_store(job, ok)` as transfers complete: a
   failed load is a miss the engine recomputes; a failed store frees its slots.
   A request with a load is allocated with `delay_cache_blocks`: its blocks enter the
   accelerator prefix cache only once their bytes are there (the hit and loaded
   blocks at a successful `finish_load`, the rest at `computed`), so no other request
   hits a block still loading or whose load failed.
4. `finish(request)` or `preempt(request)`: free the accelerator blocks.

No bytes move here: jobs carry hashes, accelerator block ids and the tier's spec,
and a data plane (or the replay, which completes them on its own clock) runs them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from kvtier.connector.chain import settle_load
from kvtier.gpu.block_pool import EvictionHook
from kvtier.gpu.kv_cache_manager import KVCacheManager
from kvtier.offload.abstract import LoadStoreSpec, OffloadingManager
from kvtier.request import Request
from kvtier.types import BlockHash

StoreOn = Literal["compute", "evict"]


class TransferJob(NamedTuple):
    """One transfer for the data plane. Immutable, and a named tuple rather than a
    frozen dataclass: one or two are built per request, and a frozen dataclass's
    construction cost three times as much (a checked assignment per field)."""

    job_id: int
    kind: Literal["load", "store"]
    request_id: str | None  # None for stores of evicted blocks (no request owns them)
    block_hashes: list[BlockHash]
    gpu_block_ids: list[int]
    spec: LoadStoreSpec
    # For stores: the tier's victims that made room (already gone from the tier).
    evicted: Sequence[BlockHash] = ()


class Admission(NamedTuple):
    """What `admit` decided (a named tuple, as `TransferJob`: one per request)."""

    gpu_hit_blocks: int
    offload_hit_blocks: int
    load: TransferJob | None
    # Stores of blocks the accelerator evicted while making room (store_on="evict").
    stores: Sequence[TransferJob] = ()


@dataclass
class ConnectorCounters:
    admitted: int = 0
    refused: int = 0
    stores_planned: int = 0
    store_rejections: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    gpu_evictions: int = 0
    # Blocks evicted from the accelerator that the tier refused to take (store_on="evict"):
    # they are gone from every tier (each refusal also counts in store_rejections).
    evicted_blocks_dropped: int = 0


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
        self._counters = ConnectorCounters()
        # The pool counts its evictions; their hashes are needed only to store them
        # (store_on="evict"): wire this hook to the pool's `on_evict` then. A C-level
        # append, no Python frame per evicted block; queued at the next admission.
        self._gpu_evicted: list[BlockHash] = []
        self.on_gpu_evict: EvictionHook = self._gpu_evicted.append
        self._gpu_evictions_before = gpu.block_pool.num_evicted
        self._job_ids = itertools.count()
        self._first_computed: dict[str, int] = {}  # request -> first block its prefill made
        self._loads: dict[int, TransferJob] = {}
        self._stores: dict[int, TransferJob] = {}
        self._evicted: list[BlockHash] = []
        # Requests whose accelerator caching waits on a load:
        # request id -> (load job id, the request, its accelerator-hit tokens).
        self._loading: dict[str, tuple[int, Request, int]] = {}
        # Requests with blocks not yet cached: request -> the tokens they were allocated.
        self._uncached: dict[str, int] = {}

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
        """An accelerator pool wired to the connector (its eviction hook when storing on
        eviction)."""
        gpu = KVCacheManager(
            block_size,
            num_gpu_blocks,
            max_model_len,
            num_preallocate_tokens=num_preallocate_tokens,
            log_stats=False,
        )
        connector = cls(gpu, offload, store_on=store_on)
        if store_on == "evict":
            gpu.block_pool.on_evict = connector.on_gpu_evict
        return connector

    @property
    def counters(self) -> ConnectorCounters:
        if self._gpu_evicted:
            self._take_gpu_evictions()
        evictions = self.gpu.block_pool.num_evicted - self._gpu_evictions_before
        self._counters.gpu_evictions = evictions
        return self._counters

    def _take_gpu_evictions(self) -> None:
        """Queue the blocks the pool evicted when storing on eviction."""
        evicted = self._gpu_evicted
        if self.store_on == "evict":
            self._evicted.extend(evicted)
        evicted.clear()

    # --- 1. admission ---------------------------------------------------------------

    def admit(self, request: Request) -> Admission | None:
        """Accelerator hit, offload continuation, allocation, load plan; None: no room."""
        blocks, gpu_tokens = self.gpu.get_computed_blocks(request)
        hashes = request.get_block_hashes(self.block_size, self.gpu.hash_algorithm)
        start, num_tokens = len(blocks), request.num_tokens
        limit = min(len(hashes), (num_tokens - 1) // self.block_size)
        ext = (self.offload.lookup(hashes[start:limit]) or 0) if start < limit else 0
        before = request.num_computed_tokens
        num_new = num_tokens - gpu_tokens
        if self.gpu.allocate_slots(request, num_new, blocks, delay_cache_blocks=ext > 0) is None:
            self._counters.refused += 1
            return None
        if self._gpu_evicted:
            self._take_gpu_evictions()
        request.num_computed_tokens = before + gpu_tokens + num_new  # the scheduler's part
        load = None
        if ext:
            load = self._plan_load(request, list(hashes[start : start + ext]), start, before)
        self._counters.admitted += 1
        self.offload.touch(hashes)
        self._first_computed[request.request_id] = start + ext
        return Admission(start, ext, load, self._store_evicted())

    def _plan_load(
        self, request: Request, loaded: list[BlockHash], start: int, before: int
    ) -> TransferJob:
        """Pin the offloaded blocks; if the tier refuses, undo the allocation and raise."""
        rid = request.request_id
        try:
            spec = self.offload.prepare_load(loaded)
        except BaseException:
            self.gpu.free(request)
            request.num_computed_tokens = before
            raise
        ids = self.gpu.get_block_ids(rid)[start : start + len(loaded)]
        load = TransferJob(next(self._job_ids), "load", rid, loaded, ids, spec)
        self._loads[load.job_id] = load
        self._loading[rid] = (load.job_id, request, start * self.block_size)
        self._uncached[rid] = request.num_computed_tokens
        return load

    # --- 2. stores ------------------------------------------------------------------

    def computed(self, request: Request) -> TransferJob | None:
        """The store job for blocks this request's prefill computed (store_on='compute')."""
        rid = request.request_id
        if rid not in self._first_computed:
            raise KeyError(f"request {rid!r} was not admitted (or already stored)")
        if rid in self._loading:
            raise ValueError(f"request {rid!r} still has a load in flight (finish_load first)")
        first = self._first_computed.pop(rid)
        tokens = self._uncached.pop(rid, None)
        if tokens is not None:  # the prefill wrote (or rewrote) them: now they may be hit
            request.num_computed_tokens = tokens
            self.gpu.cache_blocks(request, tokens)
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
            self._counters.store_rejections += 1
            if request_id is None:
                self._counters.evicted_blocks_dropped += len(hashes)
            return None
        to_store = out.block_hashes_to_store
        if not to_store and not out.block_hashes_evicted:
            return None
        if ids:  # the slots of the hashes actually stored, by their position
            # The usual case: all of them (a list equals a list only). kvtier's managers
            # take a repeated hash once, so then none repeats; a manager that stores a
            # repeated hash twice gets each listing's own slot (same bytes either way).
            if to_store == hashes:
                ids = ids[first : first + len(hashes)]
            else:
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
        self._counters.stores_planned += len(to_store)
        return job

    # --- 3. completions -------------------------------------------------------------

    def finish_load(self, job: TransferJob, ok: bool = True) -> None:
        """Unpin the loaded blocks and cache them with the accelerator hit before them.

        A failed load is a miss: the request's computed tokens go back to its
        accelerator hit, and the engine recomputes the rest (cached at `computed`).
        A load of a request freed meanwhile only unpins.
        """
        stored = self._loads.pop(job.job_id, None)
        if stored is None:
            raise KeyError(f"load job {job.job_id} is unknown or already finished")
        settle_load(self.offload, stored.block_hashes, ok)
        if not ok:
            self._counters.failed_loads += 1
        rid = stored.request_id
        entry = None if rid is None else self._loading.get(rid)
        if rid is None or entry is None or entry[0] != stored.job_id:
            return
        del self._loading[rid]
        _, request, hit_tokens = entry
        if ok:
            self.gpu.cache_blocks(request, hit_tokens + len(stored.block_hashes) * self.block_size)
        else:
            request.num_computed_tokens = hit_tokens

    def finish_store(self, job: TransferJob, ok: bool = True) -> None:
        if self._stores.pop(job.job_id, None) is None:
            raise KeyError(f"store job {job.job_id} is unknown or already finished")
        self.offload.complete_store(job.block_hashes, success=ok)
        if not ok:
            self._counters.failed_stores += 1

    # --- 4. release -----------------------------------------------------------------

    def finish(self, request: Request) -> None:
        """Free the request's accelerator blocks (tail first: its end is evicted first)."""
        self._forget(request.request_id)
        self.gpu.free(request)

    def preempt(self, request: Request) -> None:
        """Free a running request to make room; it will be admitted again later."""
        self._forget(request.request_id)
        self.gpu.preempt(request)

    def _forget(self, rid: str) -> None:
        """Drop the request's pending steps; its load, if any, will only unpin."""
        self._first_computed.pop(rid, None)
        self._loading.pop(rid, None)
        self._uncached.pop(rid, None)

    @property
    def jobs_in_flight(self) -> int:
        return len(self._loads) + len(self._stores)
