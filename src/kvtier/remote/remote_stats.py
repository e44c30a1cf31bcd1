"""What the remote tier did: hits, bytes per direction, refusals and faults."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class RemoteStats:
    """Counters of one store since it was created (a snapshot)."""

    lookups: int = 0
    lookup_hit_blocks: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    missing_blocks: int = 0  # looked up, then evicted before the load
    corrupt_blocks: int = 0
    foreign_blocks: int = 0
    malformed_blocks: int = 0
    wrong_key_blocks: int = 0
    errors: int = 0  # failed calls (timeouts, refused connections, server errors)
    full_refusals: int = 0  # writes a full server refused (noeviction); also in errors
    skipped_calls: int = 0  # refused by the open breaker
    breaker_opened: int = 0
    prefetched_blocks: int = 0  # values lookups read whole for a load here (`prefetch`)
    prefetch_loaded_blocks: int = 0  # loads served from those, without a round trip


class RemoteCounters:
    """Mutable counters behind a lock (the scheduler and workers share a store)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = dict.fromkeys((f.name for f in fields(RemoteStats)), 0)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                self.values[name] += delta

    def snapshot(self) -> RemoteStats:
        with self.lock:
            return RemoteStats(**self.values)
