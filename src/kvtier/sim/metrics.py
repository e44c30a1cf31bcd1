"""What a replay measured, per tier and in total.

Two hit notions, because they differ when ids are not chained (Bailian) or when a
policy leaves holes in a prefix:
- block hit rate (`hit_rate`): blocks served, plus blocks past the served prefix
  that a local tier holds when their request arrives — comparable with the
  infinite and Belady bounds;
- prefix hit rate (`prefix_hit_rate`): blocks a prefix cache can actually use,
  the consecutive run from the first block that the tiers served (what the
  lookups returned and what was loaded).
Token-weighted figures and prefill tokens saved count served (prefix) blocks only,
by their real token counts (a request's last block is usually partial). The whole
contract, faults included, is docs/semantics.md section 6.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.offload.tier_metrics import METRICS


def served_tokens(hit_blocks: int, block_size: int, input_length: int) -> tuple[int, int]:
    """(hit tokens, prefill tokens saved) of a request whose first `hit_blocks` were served.

    A request's last block is usually partial, so hits count real tokens; and an
    engine always computes the last prompt token again (it needs its logits), so a
    fully served prompt saves the blocks before the one holding that token.
    """
    hit_tokens = min(hit_blocks * block_size, input_length)
    saved = min(hit_blocks, max(0, input_length - 1) // block_size) * block_size
    return hit_tokens, saved


@dataclass
class TierCounters:
    """The one set of per-tier tallies a replay keeps (see `kvtier.sim.ledger`); frozen
    into `TierStats` at the end. Every figure counts what happened, not what was
    planned: a store counts once its bytes are in the tier, a hit once they reached
    the engine."""

    name: str
    capacity: int
    policy: str
    hit_blocks: int = 0
    hit_tokens: int = 0
    stores: int = 0
    evictions: int = 0
    filtered_stores: int = 0
    store_rejections: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    checksum_failures: int = 0
    # transfers to or from the tier that failed (loads, stores, disk demotions)
    errors: int = 0
    # blocks the tier lost to faults (a demotion that never reached the disk, a
    # corrupt file found and forgotten): gone without an eviction
    dropped_blocks: int = 0
    # blocks of stores shed because the tier's store queue was full (kvtier.sim.store_queues)
    shed_blocks: int = 0

    def freeze(self, block_refs: int) -> TierStats:
        return TierStats(
            **asdict(self),
            hit_rate=self.hit_blocks / block_refs if block_refs else 0.0,
        )


@dataclass(frozen=True)
class TierStats:
    name: str
    capacity: int
    policy: str
    hit_blocks: int
    hit_tokens: int
    stores: int
    evictions: int
    filtered_stores: int
    store_rejections: int
    bytes_loaded: int
    bytes_stored: int
    checksum_failures: int
    errors: int
    dropped_blocks: int
    shed_blocks: int
    # Blocks this tier served, over all block references of the trace.
    hit_rate: float


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    block_refs: int
    input_tokens: int
    any_hit_blocks: int
    prefix_hit_blocks: int
    hit_tokens: int
    prefill_tokens_saved: int
    tiers: tuple[TierStats, ...]
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    stack: str = ""  # the tiers below the accelerator, as built (`StackConfig.describe`)

    @property
    def offload_tiers(self) -> tuple[TierStats, ...]:
        """The tiers below the accelerator (whose "stores" count blocks it computed)."""
        return tuple(t for t in self.tiers if t.name != "gpu")

    @property
    def hit_rate(self) -> float:
        return self.any_hit_blocks / self.block_refs if self.block_refs else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_blocks / self.block_refs if self.block_refs else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def refs_per_s(self) -> float:
        return self.block_refs / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The per-policy entry of `kvtier replay --json` (schema fixed by issue 5)."""
        return {
            "policy": self.policy,
            "hit_rate": self.hit_rate,
            "prefix_hit_rate": self.prefix_hit_rate,
            "token_hit_rate": self.token_hit_rate,
            "hit_blocks": self.any_hit_blocks,
            "prefix_hit_blocks": self.prefix_hit_blocks,
            "prefill_tokens_saved": self.prefill_tokens_saved,
            "seconds": self.seconds,
            "stack": self.stack,
            "tiers": {
                t.name: {k: v for k, v in asdict(t).items() if k != "name"} for t in self.tiers
            },
            "metrics": replay_metrics(self.offload_tiers),
            **self.extra,
        }


# the replay's tier names and counters behind kvtier's engine metrics (kvtier.offload.tier_metrics)
_TIER_LABELS = {"cpu": "cpu", "disk": "disk", "remote": "redis"}
_REPLAY_FIELDS = {
    "load_blocks": "hit_blocks",
    "load_bytes": "bytes_loaded",
    "store_blocks": "stores",
    "store_bytes": "bytes_stored",
    "corrupt_blocks": "checksum_failures",
    "evicted_blocks": "evictions",
    "capacity_blocks": "capacity",
    "shed_blocks": "shed_blocks",
}


def replay_metrics(tiers: tuple[TierStats, ...]) -> dict[str, dict[str, int]]:
    """The replay's figures under the names vLLM's `/metrics` shows for an engine with
    kvtier (`{exposed name: {tier label: value}}`), for a line-by-line comparison."""
    out: dict[str, dict[str, int]] = {}
    for key, field_name in _REPLAY_FIELDS.items():
        name = METRICS[key].exposed
        for tier in tiers:
            label = _TIER_LABELS.get(tier.name)
            if label is not None:
                out.setdefault(name, {})[label] = getattr(tier, field_name)
    return out
