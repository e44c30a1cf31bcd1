"""The router's vocabulary, free of any transport: tiers, and events in their terms."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

# A block hash as vLLM publishes it: sha256 bytes, or a 64-bit int under
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
EventHash = bytes | int


class Tier(IntEnum):
    """Where an engine holds a block, best first (a lower value loads faster)."""

    GPU = 0
    CPU = 1
    DISK = 2
    SHARED = 3


@dataclass(frozen=True)
class TierEvent:
    """One decoded event: `kind` is "stored", "removed" or "cleared"."""

    kind: str
    tier: Tier | None = None
    block_hashes: tuple[EventHash, ...] = ()
