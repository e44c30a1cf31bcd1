"""What travels between kvtier's scheduler side and its worker inside vLLM.

A vLLM transfer job covers one list of keys; kvtier may split it between tiers (a
prefix partly in local memory or on disk, partly in the shared Redis tier), so a
job's spec is a list of parts, each naming its tier, its positions in the job's key
(and device block) order, and that tier's own kvtier spec. `discards` are disk files
the scheduler let go of (evicted or failed): the worker deletes them in job order,
before any copy of the job that may reuse their slots, as a discard job of their own
(`TransferWorker.submit_discard`), not a store.

`WorkerReport` is the way back: which parts failed, which disk blocks were found
corrupt, which demotions never reached the disk. vLLM's own connector has no channel
for failures (it asserts every transfer succeeded), so `KvtierConnector` carries
the report in its worker metadata.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import LoadStoreSpec

from kvtier.connector.tier_stack import LOCAL, REMOTE
from kvtier.offload.abstract import LoadStoreSpec as KvtierSpec
from kvtier.types import BlockHash

__all__ = ["LOCAL", "REMOTE", "KvtierLoadSpec", "KvtierStoreSpec", "Part", "WorkerReport"]


@dataclass
class Part:
    tier: str
    positions: list[int]
    block_hashes: list[BlockHash]
    spec: KvtierSpec


@dataclass
class KvtierStoreSpec(LoadStoreSpec):
    """`epoch`: the scheduler's count of resets; a job of a later epoch than the worker
    has seen tells it that every CPU slot it knew of was let go (see the worker's flush)."""

    parts: list[Part] = field(default_factory=list)
    discards: list[BlockHash] = field(default_factory=list)
    epoch: int = 0


@dataclass
class KvtierLoadSpec(LoadStoreSpec):
    """`promotion`: local slots for the blocks the remote part brings in, written from
    the device once that part has loaded (so the next hit on them is local)."""

    parts: list[Part] = field(default_factory=list)
    discards: list[BlockHash] = field(default_factory=list)
    promotion: Part | None = None
    epoch: int = 0
    # seconds the Redis part may take before the worker gives it up (its blocks are
    # recomputed): about what recomputing them costs; None: no deadline
    deadline_s: float | None = None


@dataclass
class WorkerReport:
    """Failures since the last report; `merge` sums the reports of several workers.

    `seconds`: time of the transfer jobs since the last report, by "tier:load" or
    "tier:store" (tier: cpu, disk, redis); `remote_corrupt`: Redis values refused
    at load (the scheduler side's metrics); `loads`: (tier, blocks, seconds) of each
    load part that succeeded, and `steps`: (tokens, seconds) of each engine step that
    computed tokens, for the load-or-recompute estimates (`kvtier.connector.cost_model`)."""

    failed_stores: dict[str, list[BlockHash]] = field(default_factory=dict)
    failed_loads: list[list[BlockHash]] = field(default_factory=list)
    corrupt_blocks: list[BlockHash] = field(default_factory=list)
    lost_demotions: list[BlockHash] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    remote_corrupt: int = 0
    loads: list[tuple[str, int, float]] = field(default_factory=list)
    steps: list[tuple[int, float]] = field(default_factory=list)
    # store parts shed because their tier's store queue was full, by tier (LOCAL, REMOTE)
    shed_stores: dict[str, list[BlockHash]] = field(default_factory=dict)
    # blocks of loads given up at their deadline, by the tier timed (cpu, disk, redis)
    expired_loads: dict[str, int] = field(default_factory=dict)
    # (reset epoch, block) of local stores whose CPU copy is done while their disk write
    # goes on: readable from the CPU tier once every worker has said so
    copied: list[tuple[int, BlockHash]] = field(default_factory=list)
    # bytes each tier's store queue holds now (LOCAL, REMOTE), sent while any is queued
    # and once more when it empties; merged: the fullest worker's
    queued_bytes: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        """Whether anything failed."""
        return bool(
            self.failed_stores
            or self.failed_loads
            or self.corrupt_blocks
            or self.lost_demotions
            or self.remote_corrupt
            or self.shed_stores
        )

    def worth_sending(self) -> bool:
        return bool(self) or bool(
            self.seconds or self.loads or self.steps or self.copied or self.queued_bytes
        )

    def merge(self, other: WorkerReport) -> WorkerReport:
        stores = _merged(self.failed_stores, other.failed_stores)
        seconds = dict(self.seconds)
        for key, value in other.seconds.items():
            seconds[key] = seconds.get(key, 0.0) + value
        return WorkerReport(
            stores,
            self.failed_loads + other.failed_loads,
            self.corrupt_blocks + other.corrupt_blocks,
            self.lost_demotions + other.lost_demotions,
            seconds,
            self.remote_corrupt + other.remote_corrupt,
            self.loads + other.loads,
            self.steps + other.steps,
            _merged(self.shed_stores, other.shed_stores),
            dict(Counter(self.expired_loads) + Counter(other.expired_loads)),
            self.copied + other.copied,
            {
                tier: max(self.queued_bytes.get(tier, 0), other.queued_bytes.get(tier, 0))
                for tier in self.queued_bytes.keys() | other.queued_bytes.keys()
            },
        )


def _merged(
    first: dict[str, list[BlockHash]], second: dict[str, list[BlockHash]]
) -> dict[str, list[BlockHash]]:
    """Two reports' blocks by tier, together."""
    merged = {tier: list(hashes) for tier, hashes in first.items()}
    for tier, hashes in second.items():
        merged.setdefault(tier, []).extend(hashes)
    return merged
