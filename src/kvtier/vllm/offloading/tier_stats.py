"""kvtier's per-tier figures as vLLM connector statistics (`/metrics`, with a `tier` label).

vLLM asks the scheduler side's manager for `get_stats()` every step and feeds what it
returns to its Prometheus metrics (`OffloadPromMetrics`, defined by the spec's
`build_metric_definitions`): counters as increments since the last call, gauges as
the latest value, histograms as samples. The figures come from where they are known:
lookups, loads, stores, evictions and occupancy from kvtier's managers (the ones the
replay tool drives, so an engine and a replay count alike), failures, corrupt blocks
and transfer seconds from the worker's reports, Redis lookup round trips from the
background lookup thread.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from kvtier.connector.cost_model import CostModel
from kvtier.offload.tier_metrics import BREAKER_STATES, LOOKUP_BUCKETS, METRICS

_TIER = ("tier",)
# kvtier manager counters (OffloadingStats fields) -> metric keys
_MANAGER_COUNTERS = {
    "queried_blocks": "lookup_blocks",
    "hit_blocks": "hit_blocks",
    "stored_blocks": "store_blocks",
    "evicted_blocks": "evicted_blocks",
    "failed_stores": "store_failures",
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """vLLM's definitions of kvtier's metrics, each labelled by tier."""
    definitions: dict[str, OffloadingMetricMetadata] = {}
    for metric in METRICS.values():
        if metric.kind == "counter":
            definitions[metric.name] = OffloadingCounterMetadata(metric.doc, _TIER)
        elif metric.kind == "gauge":
            definitions[metric.name] = OffloadingGaugeMetadata(metric.doc, _TIER)
        else:
            definitions[metric.name] = OffloadingHistogramMetadata(
                metric.doc, _TIER, buckets=LOOKUP_BUCKETS
            )
    return definitions


class TierStats:
    """Cumulative per-tier counts; `take()` hands vLLM what changed since the last call.

    `tiers`: tier label -> the kvtier manager holding that tier's blocks (its
    `counters`, `len` and backend size are read), None for Redis; `block_bytes`
    and `file_bytes`: one block's payload, and its disk file.
    """

    def __init__(
        self,
        tiers: dict[str, Any],
        *,
        block_bytes: int,
        file_bytes: int,
        remote: Any = None,
        cost: CostModel | None = None,
    ) -> None:
        self.tiers = tiers
        self.block_bytes = block_bytes
        self.file_bytes = file_bytes
        self.remote = remote  # the RemoteOffloadingManager, for its store and lookups
        self.cost = cost  # the load-or-recompute estimates and decisions
        self._lookup_seconds: list[float] = []  # round trips not yet handed to vLLM
        self.extra: defaultdict[tuple[str, str], float] = defaultdict(float)
        self._reported: defaultdict[tuple[str, str], float] = defaultdict(float)
        # gauges the workers report (`WorkerReport.queued_bytes`): their last value
        self.worker_gauges: dict[tuple[str, str], float] = {}

    def add(self, key: str, tier: str, value: float) -> None:
        """Count what the managers do not: Redis traffic, failures, corrupt blocks, seconds."""
        if key not in METRICS:
            raise KeyError(f"no kvtier metric {key!r}; known: {sorted(METRICS)}")
        self.extra[key, tier] += value

    def totals(self) -> dict[tuple[str, str], float]:
        """Every counter's value since the engine started, by (metric key, tier)."""
        totals: defaultdict[tuple[str, str], float] = defaultdict(float, self.extra)
        for tier, manager in self.tiers.items():
            counters = manager.counters
            for field, key in _MANAGER_COUNTERS.items():
                totals[key, tier] += getattr(counters, field)
        if self.cost is not None:
            for (tier, decision), blocks in self.cost.decisions.items():
                totals[f"decided_{decision}_blocks", tier] += blocks
        if self.remote is not None:  # (the scheduler's lookups carry them)
            totals["prefetched_blocks", "redis"] += self.remote.store.stats.prefetched_blocks
        for tier in (*self.tiers, "redis"):
            totals["load_bytes", tier] = totals["load_blocks", tier] * self.block_bytes
            totals["store_bytes", tier] = totals["store_blocks", tier] * self.block_bytes
        if self.remote is None:
            return {k: v for k, v in totals.items() if k[1] != "redis"}
        return dict(totals)

    def gauges(self) -> dict[tuple[str, str], float]:
        gauges: dict[tuple[str, str], float] = {}
        for tier, manager in self.tiers.items():
            per_block = self.file_bytes if tier == "disk" else self.block_bytes
            capacity = manager.backend.num_blocks or 0
            gauges["used_blocks", tier] = len(manager)
            gauges["capacity_blocks", tier] = capacity
            gauges["used_bytes", tier] = len(manager) * per_block
            gauges["capacity_bytes", tier] = capacity * per_block
        if self.remote is not None:
            state = self.remote.store.breaker.state.value
            gauges["breaker_state", "redis"] = BREAKER_STATES[state]
        if self.cost is not None:
            gauges |= self.cost.gauges()
        return gauges | self.worker_gauges

    def pull_lookup_seconds(self) -> None:
        """Take the Redis lookup round trips timed so far: the cost model's round-trip
        estimate follows them at once, and vLLM's histogram gets them at `take`."""
        if self.remote is None:
            return
        seconds = self.remote.take_lookup_seconds()
        if self.cost is not None:
            for value in seconds:
                self.cost.observe_round_trip("redis", value)
        self._lookup_seconds += seconds

    def take(self) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        for (key, tier), total in self.totals().items():
            delta = total - self._reported[key, tier]
            if delta > 0:
                stats.increase_counter(METRICS[key].name, delta, (tier,))
                self._reported[key, tier] = total
        for (key, tier), value in self.gauges().items():
            stats.set_gauge(METRICS[key].name, value, (tier,))
        if self.remote is not None:
            self.pull_lookup_seconds()
            seconds, self._lookup_seconds = self._lookup_seconds, []
            for value in seconds:
                stats.observe_histogram(METRICS["lookup_seconds"].name, value, ("redis",))
        return stats
