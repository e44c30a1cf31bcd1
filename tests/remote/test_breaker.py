"""The circuit breaker, by scenario and against a model (virtual time, no sleeps)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.remote.breaker import BreakerConfig, BreakerState, CircuitBreaker
from tests.remote.conftest import FakeClock


def test_opens_after_threshold_then_probes_once_and_closes() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=3, reset_timeout_s=5.0), clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and breaker.num_opened == 1
    assert not breaker.allow()
    clock.advance(4.9)
    assert not breaker.allow()
    clock.advance(0.1)
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one probe in flight
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    assert breaker.num_rejected == 3


def test_failed_probe_reopens_for_a_full_period() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=1, reset_timeout_s=2.0), clock)
    breaker.record_failure()
    clock.advance(2.0)
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and breaker.num_opened == 2
    clock.advance(1.9)
    assert not breaker.allow()
    clock.advance(0.1)
    assert breaker.allow()


def test_success_resets_the_consecutive_count() -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=2), FakeClock())
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


@pytest.mark.parametrize(
    "kwargs",
    [{"failure_threshold": 0}, {"reset_timeout_s": -1.0}, {"reset_timeout_s": float("nan")}],
)
def test_bad_config_is_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        BreakerConfig(**kwargs)  # type: ignore[arg-type]


class BreakerMachine(RuleBasedStateMachine):
    """Random interleavings of calls, outcomes and time against a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.threshold, self.period = 3, 5.0
        self.breaker = CircuitBreaker(BreakerConfig(self.threshold, self.period), self.clock)
        self.state, self.failures, self.opened_at, self.probing = "closed", 0, 0.0, False

    @rule(seconds=st.sampled_from([0.0, 1.0, 4.0, 5.0, 7.5]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def allow(self) -> None:
        if self.state == "open" and self.clock.now - self.opened_at >= self.period:
            self.state, self.probing = "half_open", False
        expected = self.state == "closed" or (self.state == "half_open" and not self.probing)
        if self.state == "half_open" and expected:
            self.probing = True
        assert self.breaker.allow() == expected

    @rule()
    def success(self) -> None:
        self.breaker.record_success()
        self.state, self.failures, self.probing = "closed", 0, False

    @rule()
    def failure(self) -> None:
        """Includes a late failure while open (a call let through before it opened)."""
        self.breaker.record_failure()
        self.failures += 1
        if self.state == "half_open" or (
            self.state == "closed" and self.failures >= self.threshold
        ):
            self.state, self.opened_at, self.probing = "open", self.clock.now, False

    @invariant()
    def same_state(self) -> None:
        # the breaker moves OPEN -> HALF_OPEN lazily, on the next allow()
        assert self.breaker.state.value == self.state

    @invariant()
    def rejecting_predicts_allow(self) -> None:
        elapsed = self.clock.now - self.opened_at >= self.period
        would_allow = (
            self.state == "closed"
            or (self.state == "open" and elapsed)
            or (self.state == "half_open" and not self.probing)
        )
        assert self.breaker.rejecting() == (not would_allow)


TestBreakerMachine = BreakerMachine.TestCase
TestBreakerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
