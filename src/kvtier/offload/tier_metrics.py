"""kvtier's per-tier metrics: one list of names, for vLLM's `/metrics` and the replay's JSON.

vLLM registers these with Prometheus from `KvtierOffloadingSpec.build_metric_definitions`,
each with a `tier` label (`cpu`, `disk`, `redis`), following vLLM's own conventions
(`vllm:` prefix, units in the name, counters exposed with `_total`). `kvtier replay
--json` writes the figures it has under the same exposed names (`replay_metrics` in
`kvtier.sim.metrics`), so a replay and an engine compare line by line. Bookkeeping
only: no vLLM and no Prometheus here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]
TIERS = ("cpu", "disk", "redis")
PREFIX = "vllm:kvtier_"
# Redis lookups take a network round trip: 100 us to a second
LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True)
class TierMetric:
    key: str  # kvtier's short name ("load_blocks")
    kind: Kind
    doc: str

    @property
    def name(self) -> str:
        """The name vLLM registers ("vllm:kvtier_load_blocks")."""
        return PREFIX + self.key

    @property
    def exposed(self) -> str:
        """The name in `/metrics` (a counter's gets `_total`, as Prometheus writes it)."""
        return self.name + "_total" if self.kind == "counter" else self.name


_METRICS = (
    TierMetric("lookup_blocks", "counter", "Blocks the engine asked the tier for (one per ask)."),
    TierMetric("hit_blocks", "counter", "Blocks the tier held when asked (lookup hits)."),
    TierMetric(
        "load_blocks",
        "counter",
        "Blocks loads took from the tier into the engine (failed ones included).",
    ),
    TierMetric("load_bytes", "counter", "Bytes of those blocks."),
    TierMetric("load_time", "counter", "Seconds of the load jobs that read the tier."),
    TierMetric("store_blocks", "counter", "Blocks stored into the tier."),
    TierMetric("store_bytes", "counter", "Bytes of those blocks."),
    TierMetric("store_time", "counter", "Seconds of the store jobs that wrote the tier."),
    TierMetric("load_failures", "counter", "Blocks of loads that failed (recomputed)."),
    TierMetric(
        "load_expired_blocks",
        "counter",
        "Blocks of loads given up at their deadline (about a recompute's time): recomputed.",
    ),
    TierMetric("store_failures", "counter", "Blocks of stores that failed (not kept)."),
    TierMetric(
        "shed_blocks",
        "counter",
        "Blocks of stores shed because the tier's store queue was full (the tier fell "
        "behind): not kept, not an error.",
    ),
    TierMetric(
        "corrupt_blocks",
        "counter",
        "Blocks that failed their checksum at load, dropped and never served.",
    ),
    TierMetric("evicted_blocks", "counter", "Blocks the tier evicted (Redis: not seen)."),
    TierMetric(
        "store_queue_bytes",
        "gauge",
        "Bytes of stores queued for the tier, not yet written (host copies of blocks and "
        "demotions included; a tensor-parallel engine's fullest worker): past the tier's "
        "store_queue_bytes bound its stores are shed.",
    ),
    TierMetric("used_blocks", "gauge", "Blocks the tier holds now (Redis: not known)."),
    TierMetric("capacity_blocks", "gauge", "Blocks the tier can hold."),
    TierMetric("used_bytes", "gauge", "Bytes the tier's blocks take now."),
    TierMetric("capacity_bytes", "gauge", "Bytes the tier may take."),
    TierMetric(
        "lookup_seconds", "histogram", "Seconds of each Redis lookup round trip (tier=redis)."
    ),
    TierMetric(
        "breaker_state", "gauge", "Redis circuit breaker: 0 closed, 1 half-open, 2 open (skipped)."
    ),
    TierMetric(
        "decided_load_blocks",
        "counter",
        "Blocks the tier held that kvtier offered the engine, their load predicted faster "
        "than recomputing them.",
    ),
    TierMetric(
        "decided_recompute_blocks",
        "counter",
        "Blocks the tier held (or may have held: a lookup not waited for) that kvtier left "
        "to recompute, their load predicted slower (each block of a request once, at its "
        "first decision, however often the engine asks again).",
    ),
    TierMetric(
        "prefetched_blocks",
        "counter",
        "Blocks Redis lookups read whole for a load in this process, where a round trip "
        "costs more than carrying them: their load takes no round trip (tier=redis).",
    ),
    TierMetric(
        "cost_round_trip_seconds",
        "gauge",
        "Moving estimate of a load's (and a lookup's) round trip to the tier.",
    ),
    TierMetric(
        "cost_load_block_seconds",
        "gauge",
        "Moving estimate of a block's transfer time in a load from the tier.",
    ),
    TierMetric(
        "cost_lookup_hit_share",
        "gauge",
        "Moving share of requests whose first block asked of the tier was there (what a "
        "lookup is expected to save, and so how long a request waits for it, scales by it).",
    ),
    TierMetric(
        "cost_recompute_block_seconds",
        "gauge",
        "Moving estimate of what recomputing one block of tokens adds to this engine's "
        "steps (tier=engine).",
    ),
    TierMetric(
        "cost_step_fixed_seconds",
        "gauge",
        "What this engine's steps cost whatever they compute, taken out of the recompute "
        "estimate (tier=engine; 0 where the estimate is the average per token of steps).",
    ),
)
METRICS: dict[str, TierMetric] = {m.key: m for m in _METRICS}
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}
