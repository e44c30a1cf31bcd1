"""The cost model's moving estimates (kvtier.connector.estimators): the step line, against a
reference fit (numpy's least squares over the same window), and what it changes in the
load-or-recompute decision."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.connector.cost_model import CostConfig, CostModel
from kvtier.connector.estimators import MIN_LINE_STEPS, StepLine

TOKENS = 32  # per block


def gpu_like_steps(cost: CostModel | StepLine, rounds: int = 4) -> None:
    """A small model on a GPU: 8 ms a step whatever it computes, 2 us a token on top;
    prompts of 4 to 64 blocks, each followed by decode steps of a few tokens."""
    for _ in range(rounds):
        for blocks in (4, 16, 64, 8):
            tokens = blocks * TOKENS
            if isinstance(cost, CostModel):
                cost.observe_step(tokens, 0.008 + 2e-6 * tokens)
                cost.observe_step(4, 0.008 + 2e-6 * 4)
            else:
                cost.add(tokens, 0.008 + 2e-6 * tokens)
                cost.add(4, 0.008 + 2e-6 * 4)


def test_a_step_line_separates_what_every_step_costs() -> None:
    line = StepLine()
    gpu_like_steps(line)
    assert line.per_token == pytest.approx(2e-6)
    assert line.fixed == pytest.approx(0.008)


def test_a_load_slower_than_a_recompute_on_a_gpu_like_engine_is_declined() -> None:
    """The average per token of whole steps prices 64 blocks' recompute at 8 ms + 4 ms
    of a 2,048-token step: a Redis load of 64 blocks over 10 ms round trips (11 ms) looks
    faster. What recomputing them adds to a step is 4 ms: the load is declined."""
    cost = CostModel(CostConfig(), TOKENS)
    gpu_like_steps(cost)
    cost.observe_round_trip("redis", 0.010)
    cost.observe_load("redis", 64, 0.011)
    assert cost.recompute_seconds(64) == pytest.approx(64 * TOKENS * 2e-6)
    assert not cost.worth_loading("redis", 64)
    assert cost.gauges()["cost_step_fixed_seconds", "engine"] == pytest.approx(0.008)
    average = cost.token_seconds.value
    assert average is not None and 64 * TOKENS * average > cost.load_seconds("redis", 64)


def test_steps_that_grow_faster_than_their_tokens_keep_the_average() -> None:
    """vLLM's CPU build: prefill grows with the square of a step's tokens; the line
    through such steps has a negative fixed part, and the average stays."""
    cost = CostModel(CostConfig(), TOKENS)
    for _ in range(4):
        for tokens in (64, 256, 1024, 2048):
            cost.observe_step(tokens, 1e-4 * tokens + 2.3e-7 * tokens**2)
    assert cost.step_line.per_token is None and cost.step_line.fixed is None
    assert cost.recompute_seconds(1) == pytest.approx(TOKENS * cost.token_seconds.value)
    assert cost.gauges()["cost_step_fixed_seconds", "engine"] == 0


def test_too_few_or_too_alike_steps_make_no_line() -> None:
    line = StepLine()
    for _ in range(3 * MIN_LINE_STEPS):
        line.add(512, 0.01)
    assert line.per_token is None  # every step alike: no slope to see
    line = StepLine()
    for i in range(MIN_LINE_STEPS - 1):
        line.add(64 * (1 + i % 4), 0.001 + 1e-6 * 64 * (1 + i % 4))
    assert line.per_token is None
    line.add(64, 0.001 + 1e-6 * 64)
    assert line.per_token == pytest.approx(1e-6)


def test_the_line_follows_the_engine_and_ignores_what_cannot_be_a_step() -> None:
    line = StepLine(window=16)
    for tokens in (64, 512) * 8:
        line.add(tokens, 0.001 + 1e-6 * tokens)
    for bad in ((0, 0.1), (-5, 0.1), (64, -1.0), (64, math.nan), (64, math.inf)):
        line.add(*bad)
    assert line.per_token == pytest.approx(1e-6)
    for tokens in (64, 512) * 8:  # the machine got three times slower per token
        line.add(tokens, 0.001 + 3e-6 * tokens)
    assert line.per_token == pytest.approx(3e-6)
    with pytest.raises(ValueError, match="step line window=1; at least 2"):
        StepLine(window=1)


WINDOW = 12


class StepLineMachine(RuleBasedStateMachine):
    """Any steps, in any order: the line is numpy's least-squares fit of the last
    WINDOW valid steps wherever its conditions hold, and nothing otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.line = StepLine(window=WINDOW)
        self.steps: list[tuple[int, float]] = []

    @rule(
        tokens=st.integers(-2, 4096),
        seconds=st.one_of(st.floats(0, 2), st.sampled_from([math.nan, -0.5, math.inf])),
    )
    def step(self, tokens: int, seconds: float) -> None:
        self.line.add(tokens, seconds)
        if tokens >= 1 and math.isfinite(seconds) and seconds >= 0:
            self.steps = [*self.steps, (tokens, seconds)][-WINDOW:]

    @rule(fixed=st.floats(0, 0.05), per_token=st.floats(1e-7, 1e-3), tokens=st.integers(1, 4096))
    def on_a_line(self, fixed: float, per_token: float, tokens: int) -> None:
        self.step(tokens, fixed + per_token * tokens)

    @invariant()
    def is_the_reference_fit(self) -> None:
        xs = [float(x) for x, _ in self.steps]
        trusted = None
        if len(xs) >= MIN_LINE_STEPS and max(xs) >= 2 * min(xs):
            slope, fixed = np.polyfit(xs, [y for _, y in self.steps], 1)
            if slope > 1e-12 and fixed >= 1e-12:
                trusted = (slope, fixed)
            elif slope > -1e-12 and fixed >= -1e-12:
                return  # on the edge: rounding decides
        if trusted is None:
            assert self.line.per_token is None and self.line.fixed is None
        else:
            assert self.line.per_token == pytest.approx(trusted[0], rel=1e-6, abs=1e-12)
            assert self.line.fixed == pytest.approx(trusted[1], rel=1e-6, abs=1e-9)


TestStepLineMachine = StepLineMachine.TestCase
TestStepLineMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


@settings(max_examples=200, deadline=None)
@given(
    fixed=st.floats(1e-4, 0.05),  # (a fixed part of 0 is the edge: rounding decides)
    per_token=st.floats(1e-7, 1e-3),
    tokens=st.lists(st.integers(1, 8192), min_size=MIN_LINE_STEPS, max_size=40),
)
def test_steps_on_a_line_give_it_back(fixed: float, per_token: float, tokens: list[int]) -> None:
    line = StepLine()
    for x in tokens:
        line.add(x, fixed + per_token * x)
    if max(tokens) >= 2 * min(tokens):
        assert line.per_token == pytest.approx(per_token, rel=1e-6)
        assert line.fixed == pytest.approx(fixed, rel=1e-6, abs=1e-9)
    else:
        assert line.per_token is None
