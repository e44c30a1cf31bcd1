"""`KvtierConnector`: vLLM's OffloadingConnector, plus a way back for failures.

vLLM 0.32's OffloadingConnector asserts that every transfer succeeds: it was written
for copies between device and host memory, which do not fail. kvtier's lower tiers
do (a full or corrupt disk, a Redis server that went away), and a figure or an
answer must never depend on a load that did not happen. This subclass changes that,
and one thing more (the last point):

- worker side: the spec's worker reports each job done (so vLLM's bookkeeping moves
  on) and keeps what failed. A failed load's device blocks go to
  `get_block_ids_with_load_errors`, which vLLM answers, under
  `"kv_load_failure_policy": "recompute"`, by recomputing from the first of them.
  The rest of the report (failed store parts, corrupt disk blocks, demotions that
  never reached the disk) rides to the scheduler in the worker metadata.
- scheduler side: the report is applied to kvtier's manager before vLLM completes
  the jobs of the same step, so a failed store is dropped instead of made readable
  and a corrupt block is forgotten instead of offered again. Under tensor parallelism
  the workers' reports are summed (vLLM completes a job once every worker has, and
  unions their load errors), so a block one worker failed on fails on all of them.
  The report also says which stores' CPU copies are done while their disk writes go
  on: readable from the CPU tier once every worker has said so, before the job ends.
- at start: models with other than attention layers (Mamba) are refused by name.
- a step with nothing to compute (every request waits for its KV, or every request
  has finished and its stores are in flight) waits a few milliseconds for the oldest
  load (or store) before it returns, and a step that schedules nothing while Redis
  lookups are out waits as long for their answers, rather than letting the engine spin
  through empty steps on the cores the copies and the lookups (and the Redis server, on
  a small machine) run on.

- before vLLM walks a request's keys, kvtier's manager is told the request's length:
  what a Redis lookup could save, and so how long the request may wait for it, is
  known at the first key (`remote_runs`), not after a pass deferred to a later step.

- each step's metadata carries the tokens it computes, and the workers time the step
  (from its metadata, bound before the forward, to its results): the engine's own
  recompute cost, which the
  scheduler side sets against each tier's load cost (`kvtier.connector.cost_model`).

Everything else, scheduling included, is vLLM's own code.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvtier.vllm.offloading.extra_config import parse_extra_config
from kvtier.vllm.offloading.job_specs import WorkerReport
from kvtier.vllm.offloading.offloading_spec import TOTAL_KV_HEADS, UNDER_KVTIER_CONNECTOR
from kvtier.vllm.offloading.prompt_keys import PromptChain
from kvtier.vllm.version import check_vllm_version

log = logging.getLogger(__name__)


@dataclass
class KvtierWorkerMetadata(OffloadingWorkerMetadata):
    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: Any) -> KvtierWorkerMetadata:
        merged = super().aggregate(other)
        report = self.report
        if isinstance(other, KvtierWorkerMetadata):
            report = report.merge(other.report)
        return KvtierWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            report=report,
        )


def check_layer_types(kv_cache_config: Any) -> None:
    """Refuse, at start, KV-cache groups that are not attention (Mamba's state-space
    layers): their cache is a per-request state, not blocks of tokens."""
    from vllm.v1.kv_cache_interface import AttentionSpec, iter_layer_specs

    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        for spec in iter_layer_specs(group.kv_cache_spec):
            if not isinstance(spec, AttentionSpec):
                raise ValueError(
                    f"KvtierConnector serves attention layers only; this model has "
                    f"{type(spec).__name__} layers ({', '.join(group.layer_names[:3])}"
                    f"{', ...' if len(group.layer_names) > 3 else ''}): state-space "
                    f"(Mamba) models are not supported"
                )


def worker_meta(meta: OffloadingWorkerMetadata | None, report: WorkerReport) -> Any:
    """One worker's metadata for this step: vLLM's, with kvtier's report. Always kvtier's
    type when there is any: vLLM sums the workers' metadata (tensor parallelism) with
    the first one's `aggregate`, and vLLM's own would drop a later worker's report."""
    if meta is None:
        return KvtierWorkerMetadata(report=report) if report.worth_sending() else None
    return KvtierWorkerMetadata(
        completed_jobs=meta.completed_jobs, transfer_stats=meta.transfer_stats, report=report
    )


# How long an empty engine step waits for a transfer or a lookup: longer frees more of the
# copy's core, but delays a request that arrives meanwhile by as much.
IDLE_STEP_WAIT_S = 0.005
# the attribute of vLLM's connector metadata that tells the workers a step's tokens
STEP_TOKENS = "kvtier_step_tokens"
# ... and the one that tells them some transfer job is not yet done on every worker
JOBS_PENDING = "kvtier_jobs_pending"


def jobs_pending(connector_scheduler: Any) -> bool:
    """Whether a transfer job of the engine is not yet done by every worker (vLLM's
    scheduler side keeps each job until all workers report it), so an empty step is
    waiting on one of them."""
    jobs = getattr(connector_scheduler, "_jobs", None)
    if jobs is None:  # another vLLM: the public, wider question
        return bool(connector_scheduler.has_pending_push_work())
    return bool(jobs)


def wait_for_lookups(manager: Any, scheduler_output: Any) -> bool:
    """On a step that schedules nothing, wait (up to IDLE_STEP_WAIT_S) for the manager's
    lookups in flight (answers vLLM is told to ask for again); whether it waited. Each
    empty step runs every worker, and a tensor-parallel engine's empty steps left the
    Redis lookups of a 4,096-token prompt too little CPU to answer within the timeout."""
    wait = getattr(manager, "wait_lookups", None)
    if wait is None or scheduler_output.total_num_scheduled_tokens:
        return False
    wait(IDLE_STEP_WAIT_S)
    return True


class KvtierConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        check_vllm_version()
        check_layer_types(kv_cache_config)
        self._idle_step = False  # the current step computes nothing (see get_finished)
        self._jobs_pending = False  # some job is still running on some worker (ditto)
        self._step: tuple[int, float] | None = None  # (tokens, start) of the step running
        token = UNDER_KVTIER_CONNECTOR.set(True)
        heads = TOTAL_KV_HEADS.set(vllm_config.model_config.get_total_num_kv_heads())
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            TOTAL_KV_HEADS.reset(heads)
            UNDER_KVTIER_CONNECTOR.reset(token)
        transfer = vllm_config.kv_transfer_config
        if self.connector_scheduler is not None and transfer.kv_load_failure_policy != "recompute":
            log.warning(
                "kvtier: kv_load_failure_policy is %r: a request whose kvtier load fails "
                "(a corrupt disk block, Redis down) ends with an error instead of being "
                'recomputed; set "kv_load_failure_policy": "recompute"',
                transfer.kv_load_failure_policy,
            )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """The earliest call vLLM makes into a connector class: while it builds its
        config, in the process that parses the command line, before any engine or worker
        process starts (on builds with full CUDA graphs, vLLM's GPU default). A bad
        `kv_connector_extra_config` stops the start there, with one message naming the
        key, instead of in the middle of a worker's traceback. kvtier's connector runs
        no layer-wise transfers: CUDA graphs need no piecewise mode for it."""
        if extra_config.get("spec_name") == "KvtierOffloadingSpec":
            parse_extra_config(extra_config)
        return False

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tells kvtier's manager the request's length before vLLM walks its keys: what
        a Redis lookup could save (and so how long it may hold the request) is then
        known at the first key, not after a whole pass deferred to a later step. The
        walk's Redis lookups go out together, in one round trip (`held_lookups`)."""
        manager = getattr(self.connector_scheduler, "manager", None)
        note = getattr(manager, "note_prompt", None)
        if note is not None:
            note(request.request_id, request.num_tokens, self._prompt_chain(request))
        hold = getattr(manager, "held_lookups", None)
        with nullcontext() if hold is None else hold():  # the walk's lookups in one trip
            matched: tuple[int | None, bool] = super().get_num_new_matched_tokens(
                request, num_computed_tokens
            )
        return matched

    def _prompt_chain(self, request: Any) -> PromptChain | None:
        """The request's offload keys of its first KV-cache group, as vLLM's scheduler
        side makes them (`update_offload_keys`: a chunk's key is its last block's hash
        and the group), read by the manager only where it needs them."""
        config = getattr(self.connector_scheduler, "config", None)
        groups = getattr(config, "kv_group_configs", None)
        hashes = getattr(request, "block_hashes", None)
        if not groups or hashes is None:
            return None
        return PromptChain(hashes, groups[0].hashes_per_chunk, groups[0].group_idx)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        # no attention metadata: vLLM runs this step only for the connector (every
        # request is waiting, most likely for a kvtier load, or stores are in flight)
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Bound before the step's forward (vLLM starts asynchronous loads after it): the
        step's timing for the recompute estimate starts here."""
        super().bind_connector_metadata(connector_metadata)
        tokens = getattr(connector_metadata, STEP_TOKENS, 0)
        self._jobs_pending = bool(getattr(connector_metadata, JOBS_PENDING, False))
        self._step = (tokens, time.perf_counter()) if tokens else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """On a step with nothing to compute, wait (up to IDLE_STEP_WAIT_S) for the oldest
        load (or, with none, store) instead of returning at once: vLLM would run the next
        empty step right away, and its engine loop spinning through empty steps takes the
        cores the copies need (on the CPU platform, the very core: vLLM binds the worker's
        thread to it) and, on a small machine, the Redis server's. A worker with none of
        its own while another worker's part of a job runs (tensor parallelism: the
        worker that finished first) waits as long, idle: returning at once, it spun
        through vLLM's message queues with the engine core and starved the other
        worker's Redis load (issue 37)."""
        worker = self._kvtier_worker()
        if worker is not None and self._step is not None:  # the recompute estimate
            tokens, started = self._step
            worker.note_step(tokens, time.perf_counter() - started)
            self._step = None
        if worker is not None and self._idle_step:
            worker.wait_for_transfer(IDLE_STEP_WAIT_S, others=self._jobs_pending)
        finished: tuple[set[str], set[str]] = super().get_finished(finished_req_ids)
        return finished

    def _kvtier_worker(self) -> Any:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker if hasattr(worker, "take_report") else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._kvtier_worker()
        return worker.take_load_errors() if worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        meta = super().build_connector_worker_meta()
        worker = self._kvtier_worker()
        return worker_meta(meta, worker.take_report() if worker is not None else WorkerReport())

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self.connector_scheduler is not None:
            wait_for_lookups(self.connector_scheduler.manager, scheduler_output)
        meta = super().build_connector_meta(scheduler_output)
        setattr(meta, STEP_TOKENS, scheduler_output.total_num_scheduled_tokens)
        if self.connector_scheduler is not None:
            setattr(meta, JOBS_PENDING, jobs_pending(self.connector_scheduler))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvtierWorkerMetadata) and meta.report.worth_sending():
            manager = self.scheduler.manager
            if hasattr(manager, "apply_worker_report"):
                manager.apply_worker_report(meta.report)
        super().update_connector_output(connector_output)
