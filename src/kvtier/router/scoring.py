"""Which engine a request goes to: the routing decision, shared by the HTTP proxy and
the multi-engine replay so that both decide alike.

KV-aware: each engine's score is the share of the prompt's blocks it can serve as a
prefix, each block weighed by the tier it would come from (a pool hit costs nothing,
a CPU or disk block a copy, a shared Redis block a network read), less a penalty per
request in flight through the router. The best score wins; ties (and cold prompts,
which every engine scores alike) go to the least loaded engine, and among those to
the next in turn, so that cold conversations spread over the engines instead of
piling onto the first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.router.tiers import Tier

POLICIES = ("kv", "round-robin")
# Scores this close count as a tie (float sums of the weights).
_EPSILON = 1e-9


@dataclass(frozen=True)
class Weights:
    """What a cached block is worth by tier (a pool hit is 1), and what one request in
    flight costs, in the same units (a whole prompt served from the pool scores 1)."""

    gpu: float = 1.0
    cpu: float = 0.8
    disk: float = 0.5
    shared: float = 0.3
    load: float = 0.1

    def __post_init__(self) -> None:
        for name in ("gpu", "cpu", "disk", "shared", "load"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"weight {name} must be >= 0, got {value!r}")

    def of(self, tier: Tier) -> float:
        return (self.gpu, self.cpu, self.disk, self.shared)[tier]


# engine -> the tiers of the longest prefix of the prompt it can serve
PrefixOf = Callable[[str], Sequence[Tier]]


@dataclass(frozen=True)
class Decision:
    engine: str
    reason: str  # "prefix" (a cached prefix decided), "load", "turn" or "round-robin"
    cached_blocks: int  # blocks of the prompt the chosen engine can serve
    scores: dict[str, float]


class Chooser:
    """Stateful only in whose turn it is (ties, round-robin)."""

    def __init__(self, policy: str = "kv", weights: Weights | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(POLICIES)}")
        self.policy = policy
        self.weights = weights or Weights()
        self._turn = 0

    def choose(
        self,
        engines: Sequence[str],
        prompt_blocks: int,
        prefix_of: PrefixOf,
        in_flight: Callable[[str], int],
    ) -> Decision:
        """`engines`: those that can take a request now, in a fixed order."""
        if not engines:
            raise ValueError("no engine to route to")
        prefixes = {e: prefix_of(e) for e in engines}
        if self.policy == "round-robin":
            engine = self._next(engines)
            return Decision(engine, "round-robin", len(prefixes[engine]), {})
        w = self.weights
        scores = {}
        for e in engines:
            cached = sum(w.of(t) for t in prefixes[e]) / prompt_blocks if prompt_blocks else 0.0
            scores[e] = cached - w.load * in_flight(e)
        best = max(scores.values())
        tied = [e for e in engines if scores[e] >= best - _EPSILON]
        reason = "prefix"
        if len(tied) > 1:
            least = min(in_flight(e) for e in tied)
            tied = [e for e in tied if in_flight(e) == least]
            reason = "load" if len(tied) == 1 else "turn"
        elif all(not prefixes[e] for e in engines):
            reason = "load"
        engine = tied[0] if len(tied) == 1 else self._next(tied)
        return Decision(engine, reason, len(prefixes[engine]), scores)

    def _next(self, candidates: Sequence[str]) -> str:
        engine = candidates[self._turn % len(candidates)]
        self._turn += 1
        return engine
