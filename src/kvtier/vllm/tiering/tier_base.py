"""What kvtier's secondary tiers for vLLM's `TieringOffloadingSpec` share.

A tier entry `{"type": "KvtierDiskTier" | "KvtierRedisTier", "module_path":
"kvtier.vllm", ...options}` in `secondary_tiers` makes vLLM build one of these with
every other key of the entry (including `locality`) as a keyword; an unknown or
missing option is a ValueError naming it and the allowed ones, at engine start.

The contract vLLM asks of a secondary tier, and how it is kept:

- Every method runs on the scheduler thread and never blocks on I/O: the disk
  tier's index is in memory; the Redis tier answers lookups from a background
  thread (RETRY until the answer is in, see `secondary_tiers_lookup`).
- `submit_store` / `submit_load` copy between the primary tier's rows (the shared
  memoryview) and the medium on a kvtier `TransferWorker`'s threads, straight from
  and into the rows (no staging copy). A full queue, a server or disk failure, a
  missing or corrupt block: the job fails, nothing raises.
- `get_finished_jobs` reports a promotion that failed in part with the keys that did
  load (a failed job is retried block by block to find them); the failed keys are
  dropped from the tier (disk) or marked a miss (Redis), so vLLM recomputes them and
  does not retry a doomed promotion.
- `drain_jobs` waits for the submitted jobs to end (a worker never abandons a copy);
  `shutdown` stops the threads and closes files and connections.

Blocks are the primary tier's rows as opaque bytes, under a layout fingerprint made
of vLLM's own identity of the run (the fields its file-system tier names directories
with: model, dtype, parallelism, KV groups) and the row size: engines of one model
share blocks, any other engine never reads them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import Locality, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError
from kvtier.transfer.device import DeviceKV, cache_shape
from kvtier.transfer.handlers import StagedHandler
from kvtier.transfer.transfer_worker import TransferWorker
from kvtier.types import BlockHash

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

MAX_QUEUED_JOBS = 1024  # per direction; a job over this fails at once (vLLM recomputes)


def row_layout(spec: OffloadingSpec, row_bytes: int) -> KVLayout:
    """The primary tier's rows as a kvtier layout: one opaque row of bytes per block."""
    if row_bytes < 2 or row_bytes % 2:
        raise ValueError(f"primary tier rows must be an even number of bytes, got {row_bytes}")
    identity = FileMapper.from_offloading_spec(
        "", spec, blocks_per_file=spec.blocks_per_chunk, parallel_agnostic=True
    ).get_run_config()
    return KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_size=row_bytes // 2,  # K and V planes of one "layer": the whole row
        block_size=1,
        dtype="uint8",
        per_layer=False,
        model_id="vllm-tiering:" + json.dumps(identity, sort_keys=True),
        hash_scheme="vllm-offload-key",
    )


def primary_rows(view: memoryview, layout: KVLayout) -> DeviceKV:
    """The primary tier's memoryview as kvtier's device KV (shared memory, no copy)."""
    rows = np.asarray(view).view(np.uint8)
    tensor = torch.from_numpy(rows).view(cache_shape(layout, rows.shape[0]))
    return DeviceKV(layout, [tensor])


def check_options(
    tier: str, options: dict[str, Any], allowed: Collection[str], required: Collection[str]
) -> None:
    for name in sorted(options):
        if name not in allowed:
            raise ValueError(
                f"{tier}: unknown option {name!r} in its secondary_tiers entry; "
                f"allowed: {sorted(allowed)}"
            )
    for name in sorted(required):
        if name not in options:
            raise ValueError(
                f"{tier}: option {name!r} is required in its secondary_tiers entry; "
                f"allowed: {sorted(allowed)}"
            )


class JobSpec(LoadStoreSpec):
    """One job's blocks; a load records here which of them failed (by position)."""

    def __init__(self, block_hashes: list[BlockHash]) -> None:
        self.block_hashes = block_hashes
        self.failed: list[int] | None = None  # None: no block was tried

    @staticmethod
    def medium() -> str:
        return "KVTIER_SECONDARY"


class _JobStore:
    """The `BlockStore` a transfer worker drives: the tier's own write and read, plus
    per-block outcomes for a load that fails (each block is then read alone)."""

    def __init__(self, tier: KvtierSecondaryTier) -> None:
        self._tier = tier

    @property
    def layout(self) -> KVLayout:
        return self._tier.layout

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        assert isinstance(spec, JobSpec)  # only this module makes the worker's specs
        self._tier.write(spec.block_hashes, blocks)

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        assert isinstance(spec, JobSpec)
        try:
            self._tier.read(spec.block_hashes, blocks)
            spec.failed = []
            return
        except Exception as exc:
            log.debug("kvtier: load of %d blocks failed (%s)", len(blocks), repr(exc))
        failed = []
        for i, (block_hash, block) in enumerate(zip(spec.block_hashes, blocks, strict=True)):
            try:
                self._tier.read([block_hash], [block])
            except Exception:
                failed.append(i)
        spec.failed = failed
        if failed:
            raise BlockLoadError(f"{len(failed)} of {len(blocks)} blocks not servable")


@dataclass
class _Job:
    keys: list[OffloadKey]  # every key of vLLM's job
    sent: list[int]  # positions of the keys the worker moves
    spec: JobSpec
    is_load: bool


class KvtierSecondaryTier(SecondaryTierManager):
    """What both tiers share: options, the primary rows, the worker and the jobs.

    A subclass names its options and implements the medium's bookkeeping (`reserve`,
    `stored`, `pin`, `loaded`), its bytes (`write`, `read`) and `lookup`.
    """

    OPTIONS: ClassVar[frozenset[str]]
    REQUIRED: ClassVar[frozenset[str]] = frozenset()
    DEFAULT_LOCALITY: ClassVar[Locality]

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        name = type(self).__name__
        check_options(name, options, self.OPTIONS | {"locality"}, self.REQUIRED)
        locality = options.pop("locality", None)
        if locality is not None and locality not in {m.value for m in Locality}:
            raise ValueError(
                f"{name}: locality must be one of {[m.value for m in Locality]}, got {locality!r}"
            )
        self.locality = Locality(locality) if locality is not None else self.DEFAULT_LOCALITY
        self.layout = row_layout(offloading_spec, self.block_size_bytes)
        self.tokens_per_chunk = offloading_spec.tokens_per_hash * offloading_spec.blocks_per_chunk
        self.open(options)
        handler = StagedHandler(primary_rows(primary_kv_view, self.layout), _JobStore(self))
        self._worker = TransferWorker(handler, max_queued_jobs=MAX_QUEUED_JOBS)
        self._jobs: dict[int, _Job] = {}
        self._ready: list[JobResult] = []
        self._closed = False

    # --- the medium (subclasses) ---------------------------------------------

    def open(self, options: dict[str, Any]) -> None:
        raise NotImplementedError

    def key(self, key: OffloadKey) -> BlockHash:
        """The medium's name for a vLLM key."""
        return BlockHash(key)

    def reserve(self, hashes: list[BlockHash]) -> list[int] | None:
        """Positions of the blocks to write (the others are there or on their way);
        None: refused (medium full of pinned blocks, or known down)."""
        raise NotImplementedError

    def stored(self, hashes: list[BlockHash], success: bool) -> None:
        raise NotImplementedError

    def pin(self, hashes: list[BlockHash]) -> list[int]:
        """Positions of the blocks that can be loaded, pinned until `loaded`."""
        raise NotImplementedError

    def loaded(self, pinned: list[BlockHash], failed: list[OffloadKey]) -> None:
        """Unpin; `failed` (keys not loaded, pinned or not) must not be promoted again."""
        raise NotImplementedError

    def write(self, hashes: Sequence[BlockHash], rows: Sequence[memoryview]) -> None:
        raise NotImplementedError

    def read(self, hashes: Sequence[BlockHash], rows: Sequence[memoryview]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # --- vLLM's SecondaryTierManager -----------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def _submit(self, job: TransferJob, *, is_load: bool) -> None:
        keys = list(job.keys)
        hashes = [self.key(k) for k in keys]
        try:
            sent = self.pin(hashes) if is_load else self.reserve(hashes)
        except Exception:  # a bookkeeping bug must fail the job, not the scheduler
            what = "load" if is_load else "store"
            log.exception("kvtier %s: %s job %d refused", self.tier_type, what, job.job_id)
            sent = None
        if not sent:  # refused, nothing loadable, or (a store) nothing new to write
            success = sent is not None and not is_load
            self._ready.append(JobResult(job.job_id, success, transfer_bytes=0))
            if is_load:
                self.loaded([], keys)
            return
        spec = JobSpec([hashes[i] for i in sent])
        pending = self._jobs[job.job_id] = _Job(keys, sent, spec, is_load)
        chunk_ids = np.asarray(job.chunk_ids, dtype=np.int64)[sent]
        try:
            if is_load:
                self._worker.submit_load(job.job_id, spec, chunk_ids)
            else:
                self._worker.submit_store(job.job_id, chunk_ids, spec)
        except Exception:  # e.g. ids outside the primary rows: fail this job only
            log.exception("kvtier %s: job %d not submitted", self.tier_type, job.job_id)
            del self._jobs[job.job_id]
            self._ready.append(self._complete(job.job_id, pending, False, 0.0, 0))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._ready = self._ready, []
        for done in self._worker.get_finished():
            job = self._jobs.pop(done.job_id)
            results.append(self._complete(done.job_id, job, done.ok, done.seconds, done.bytes))
        return results

    def _complete(self, job_id: int, job: _Job, ok: bool, seconds: float, nbytes: int) -> JobResult:
        """Settle a job's bookkeeping; vLLM's result, with the keys that loaded if some failed."""
        sent = job.spec.block_hashes
        if not job.is_load:
            self.stored(sent, ok)
            return JobResult(job_id, ok, None, seconds, nbytes)
        failed_at = set(job.spec.failed) if job.spec.failed is not None else None
        loaded = {
            job.sent[i]
            for i in range(len(sent))
            if ok or (failed_at is not None and i not in failed_at)
        }
        failed = [k for i, k in enumerate(job.keys) if i not in loaded]
        self.loaded(sent, failed)
        if not failed:
            return JobResult(job_id, True, None, seconds, nbytes)
        good = tuple(job.keys[i] for i in sorted(loaded)) or None
        return JobResult(job_id, False, good, seconds, nbytes)

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._ready)

    def drain_jobs(self) -> None:
        self._worker.wait(list(self._jobs))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._worker.close()
        self.close()
        # the worker's handler holds views of the primary tier's rows: drop them, or
        # vLLM could not release its memoryview and unmap the rows after us
        del self._worker
