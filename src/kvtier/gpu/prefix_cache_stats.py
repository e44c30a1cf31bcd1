"""Prefix-cache hit statistics, counted in both blocks and tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since the last reset: one query per `get_computed_blocks` call.

    Queries count what was asked (all of the request's tokens, all of its full-block
    hashes); hits count what was served from the cache.
    """

    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    preempted_requests: int = 0
    preempted_queried_tokens: int = 0
    preempted_hit_tokens: int = 0

    def record(
        self, num_tokens: int, num_blocks: int, hit_blocks: int, hit_tokens: int, preemptions: int
    ) -> None:
        """One lookup; a request preempted before is also counted on its own."""
        self.requests += 1
        self.queried_tokens += num_tokens
        self.hit_tokens += hit_tokens
        self.queried_blocks += num_blocks
        self.hit_blocks += hit_blocks
        if preemptions:
            self.preempted_requests += 1
            self.preempted_queried_tokens += num_tokens
            self.preempted_hit_tokens += hit_tokens

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0
