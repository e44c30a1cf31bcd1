"""A circuit breaker: a failing remote tier costs a miss, not a timeout per call.

When the server is down every call would wait for its socket timeout before
failing, and the scheduler would pay that on every step. After
`failure_threshold` consecutive failures the breaker opens and calls are refused
at once (the tier reports a miss; the engine recomputes). After
`reset_timeout_s` one probe call is let through (half-open): success closes the
breaker, failure opens it for another period. The clock is injected so tests
drive time without sleeping; a lock makes it safe for the scheduler thread and
the transfer workers at once.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 3
    reset_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if not self.reset_timeout_s >= 0:
            raise ValueError(f"reset_timeout_s must be >= 0, got {self.reset_timeout_s}")


class CircuitBreaker:
    def __init__(
        self,
        config: BreakerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False
        self.num_opened = 0
        self.num_rejected = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """May a call go to the server now? A refusal is counted; the caller treats it as a miss.

        Half-open lets exactly one probe through until its outcome is recorded,
        so a dead server is not hit by every thread at once when the period ends.
        """
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if (
                self._state is BreakerState.OPEN
                and self._clock() - self._opened_at >= self.config.reset_timeout_s
            ):
                self._state = BreakerState.HALF_OPEN
                self._probe_in_flight = False
            if self._state is BreakerState.HALF_OPEN and not self._probe_in_flight:
                self._probe_in_flight = True
                return True
            self.num_rejected += 1
            return False

    def rejecting(self) -> bool:
        """Would `allow()` refuse now? Read-only: does not take the half-open probe."""
        with self._lock:
            if self._state is BreakerState.OPEN:
                return self._clock() - self._opened_at < self.config.reset_timeout_s
            return self._state is BreakerState.HALF_OPEN and self._probe_in_flight

    def record_success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._probe_in_flight = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED
                and self._failures >= self.config.failure_threshold
            ):
                self._open()

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._probe_in_flight = False
        self.num_opened += 1
