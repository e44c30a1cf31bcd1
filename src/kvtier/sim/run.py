"""`replay`: build the tiers, the tally, the bytes plane and the step, drive it, report.

Which mode runs is a matter of plug-ins, not of separate loops: the step has an
accelerator tier in front or not (`ConnectorStep` / `OffloadStep`), the clock lands
completions at once or at virtual times, the bytes plane moves real bytes or none.
Every combination of tiers works with every combination of those. The one
exception is a bare CPU tier with neither bytes nor a clock, which runs a
specialised loop (`kvtier.sim.fast_loop`) held to the same figures by the tests.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import TYPE_CHECKING

from kvtier.sim.bytes_plane import BytesPlane, NoBytes
from kvtier.sim.clock import VirtualClock, Waits, at_once
from kvtier.sim.fast_loop import fast_offload_loop
from kvtier.sim.ledger import Ledger
from kvtier.sim.metrics import ReplayResult, TierCounters
from kvtier.sim.replay_config import Progress, ReplayConfig
from kvtier.sim.stack import TierStack, build_stack
from kvtier.sim.step import ConnectorStep, OffloadStep, Step
from kvtier.sim.store_queues import StoreQueues
from kvtier.sim.workload import Workload

if TYPE_CHECKING:
    from kvtier.connector import OffloadConnector


def needs_torch(config: ReplayConfig) -> None:
    """Refuse `data=True` up front, naming the extra, when torch is not installed."""
    if not config.data:
        return
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        raise ValueError(
            "moving real bytes (--data) needs torch: pip install 'kvtier[torch]' "
            "(or `make test`, which installs it)"
        ) from None


def replay(
    workload: Workload,
    config: ReplayConfig,
    progress: Progress | None = None,
    *,
    general: bool = False,
) -> ReplayResult:
    """Replay the workload once under `config` and measure every tier.

    `general=True` runs the general step even where the specialised loop would (for
    the tests and the benchmark that compare the two)."""
    needs_torch(config)
    layout = None
    if config.data:
        from kvtier.sim.bytes_plane import small_layout

        model = "kvtier-replay"
        if config.redis_url:  # the fingerprint namespaces the blocks in Redis
            model += "/" + (config.redis_namespace or f"replay-{uuid.uuid4().hex}")
        layout = small_layout(workload.block_size, model_id=model)
    with contextlib.ExitStack() as closing:  # closes the bytes plane, then the tiers
        stack = build_stack(workload, config, layout)
        closing.callback(stack.close)
        ledger = new_ledger(workload, config, stack)
        plane: BytesPlane = NoBytes()
        data_plane = None
        if layout is not None:
            from kvtier.sim.bytes_plane import DataPlane

            longest = max((len(ids) for ids in workload.block_ids), default=1)
            data_plane = DataPlane(layout, config.gpu_blocks or longest, stack, ledger)
            closing.callback(data_plane.close)
            plane = data_plane
        started = time.perf_counter()
        extra = _drive(workload, config, stack, plane, ledger, progress, general)
        seconds = time.perf_counter() - started
        if data_plane is not None:
            data_plane.take_checksum_failures()
    _fold_remote(stack, ledger)
    if stack.recovery is not None:
        extra["disk_recovery"] = {
            "directory": stack.recovery.directory,
            "recovered_blocks": stack.recovery.recovered_blocks,
            "dropped_files": stack.recovery.dropped_files,
        }
    return ReplayResult(
        policy=config.policy,
        block_refs=workload.block_refs,
        input_tokens=workload.input_tokens,
        any_hit_blocks=ledger.any_hits,
        prefix_hit_blocks=ledger.prefix_hits,
        hit_tokens=ledger.hit_tokens,
        prefill_tokens_saved=ledger.prefill_tokens_saved,
        tiers=ledger.freeze(),
        seconds=seconds,
        extra=extra,
        stack=stack.description,
    )


def new_ledger(workload: Workload, config: ReplayConfig, stack: TierStack) -> Ledger:
    """The tally of one replay of `stack` (and its accelerator tier, if any)."""
    counters = stack.counters()
    if config.gpu_blocks:
        counters.insert(0, TierCounters("gpu", config.gpu_blocks, "lru"))
    ledger = Ledger(workload, counters)
    ledger.preloaded(stack.take_events())  # blocks a reopened disk directory holds
    return ledger


def new_step(
    workload: Workload, config: ReplayConfig, stack: TierStack, plane: BytesPlane, ledger: Ledger
) -> tuple[Step, OffloadConnector | None]:
    """The per-request step over `stack`: through an accelerator tier and its connector
    when the config has one (returned too), else straight to the offload tiers."""
    if not config.gpu_blocks:
        return OffloadStep(workload, stack, plane, ledger), None
    from kvtier.connector import OffloadConnector

    longest = max((r.input_length + r.output_length for r in workload.requests), default=1)
    connector = OffloadConnector.create(
        stack.manager,
        block_size=workload.block_size,
        num_gpu_blocks=config.gpu_blocks,
        max_model_len=longest + 1,
        store_on=config.store_on,
    )
    return ConnectorStep(workload, connector, stack, plane, ledger), connector


def _drive(
    workload: Workload,
    config: ReplayConfig,
    stack: TierStack,
    plane: BytesPlane,
    ledger: Ledger,
    progress: Progress | None,
    general: bool,
) -> dict[str, object]:
    """Run every request; returns what only some modes have to say."""
    fast = not (general or config.gpu_blocks or config.data or config.time_model)
    if (
        fast
        and stack.manager is stack.local
        and stack.cascade is None
        and config.store_threshold < 2  # no filter in front
    ):
        fast_offload_loop(stack.manager, ledger, progress)
        _end(progress, workload)
        return {}
    step, connector = new_step(workload, config, stack, plane, ledger)
    offload_step = step if isinstance(step, OffloadStep) else None
    waits: Waits
    if config.time_model is None:
        waits = at_once(step, progress)
    else:
        clock = VirtualClock(workload, step, config.time_model)
        if config.store_queues is not None and isinstance(step, OffloadStep | ConnectorStep):
            step.queues = StoreQueues(config.store_queues, lambda: clock.now)
        waits = clock.run(progress)
    _end(progress, workload)
    if offload_step is not None:
        refused = offload_step.refused
    elif connector is not None:
        refused = connector.counters.store_rejections
        ledger.tiers["gpu"].evictions = connector.counters.gpu_evictions
    for tier, count in stack.refusals(refused).items():
        ledger.tiers[tier].store_rejections += count
    if connector is None:
        return {}
    return {
        "unschedulable_requests": waits.unschedulable,
        "waited": waits.waited,
        "evicted_blocks_dropped": connector.counters.evicted_blocks_dropped,
    }


def _end(progress: Progress | None, workload: Workload) -> None:
    if progress is not None:
        progress(len(workload.requests))


def _fold_remote(stack: TierStack, ledger: Ledger) -> None:
    """What only the Redis server's client saw: bytes, corrupt values, failed calls,
    writes refused by a full server (`noeviction`)."""
    if stack.remote is None:
        return
    s, remote = stack.remote.stats, ledger.tiers["remote"]
    remote.bytes_stored, remote.bytes_loaded = s.stored_bytes, s.loaded_bytes
    remote.checksum_failures += s.corrupt_blocks
    remote.errors += s.errors + s.skipped_calls
    remote.store_rejections += s.full_refusals
