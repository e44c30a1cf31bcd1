"""Values a Redis lookup read whole, kept for the load that follows in the same process.

A hit in a slow Redis costs two round trips: the lookup that finds it, then the load
that reads it. Through a link adding 0.2 s, a returning conversation's 16-block history
took 0.4 s to load where recomputing it took 0.3 s, so kvtier either waited and lost or
recomputed and gained nothing. Where a round trip costs more than carrying a block, the
lookup reads the first blocks it asks about whole (a GET where it would read a header),
and the load finds them here: one round trip for lookup and load together.

This only pays where the load runs in the process that looked up: vLLM's engine with one
worker runs the scheduler and the worker in one process. A worker's store says so
(`serve`, with the key base of the values it loads); a lookup reads values whole only for
a key base some worker here serves, so a tensor-parallel engine, whose workers are other
processes, and the replay tool never read a byte they would not use.

Bounded: at most `max_bytes` held (the oldest dropped first), and a value not taken
within `max_age_s` is dropped (its request recomputed, or another engine's eviction may
have made it stale in a way that does not matter: values are named by their content and
verified at load like any other). Nothing here is trusted: a load decodes and checks a
value taken from here exactly as one read from Redis.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.validate import positive_int, seconds

MAX_BYTES = 256 * 1024 * 1024
MAX_AGE_S = 5.0


class PrefetchedValues:
    """Whole values by Redis key, for the next load of them in this process (see the
    module docstring). Thread-safe: a lookup thread puts, the workers' threads take."""

    def __init__(
        self,
        max_bytes: int = MAX_BYTES,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        positive_int("prefetch max_bytes", max_bytes)
        if seconds("prefetch max_age_s", max_age_s) <= 0:
            raise ValueError(f"prefetch max_age_s={max_age_s!r}; a number of seconds > 0")
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._values: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self._served: dict[bytes, int] = {}  # key base -> workers here that load it

    # -- who loads here --------------------------------------------------------------

    def serve(self, key_base: bytes) -> None:
        """A worker in this process loads values whose keys start with `key_base`."""
        with self._lock:
            self._served[key_base] = self._served.get(key_base, 0) + 1

    def unserve(self, key_base: bytes) -> None:
        with self._lock:
            left = self._served.get(key_base, 0) - 1
            if left > 0:
                self._served[key_base] = left
            else:
                self._served.pop(key_base, None)

    def serves(self, key_base: bytes) -> bool:
        """Whether a lookup of keys under `key_base` may read values whole here."""
        return key_base in self._served

    # -- the values ------------------------------------------------------------------

    def put(self, key: bytes, value: bytes) -> bool:
        """Keep `value` for a load of `key`; False where it could not be kept (larger
        than the whole budget)."""
        size = len(value)
        if size > self.max_bytes:
            return False
        with self._lock:
            self._expire(self._clock())
            old = self._values.pop(key, None)
            if old is not None:
                self._bytes -= len(old[0])
            while self._values and self._bytes + size > self.max_bytes:
                _, (dropped, _) = self._values.popitem(last=False)
                self._bytes -= len(dropped)
            self._values[key] = (value, self._clock())
            self._bytes += size
        return True

    def take(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's value (taken: a value serves one load), None where not held."""
        with self._lock:
            self._expire(self._clock())
            out: list[bytes | None] = []
            for key in keys:
                held = self._values.pop(key, None)
                if held is None:
                    out.append(None)
                    continue
                self._bytes -= len(held[0])
                out.append(held[0])
            return out

    def count(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` are held now (a load planned of them reads those here)."""
        with self._lock:
            self._expire(self._clock())
            return sum(key in self._values for key in keys)

    def clear(self, key_base: bytes = b"") -> None:
        """Drop every value whose key starts with `key_base` (all by default)."""
        with self._lock:
            for key in [k for k in self._values if k.startswith(key_base)]:
                value, _ = self._values.pop(key)
                self._bytes -= len(value)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._values)

    def _expire(self, now: float) -> None:
        values = self._values
        while values:
            key, (value, at) = next(iter(values.items()))
            if now - at <= self.max_age_s:
                return
            del values[key]
            self._bytes -= len(value)


# this process's: the scheduler's lookups and an in-process worker's loads meet here
PREFETCHED = PrefetchedValues()


__all__ = ["MAX_AGE_S", "MAX_BYTES", "PREFETCHED", "PrefetchedValues"]
