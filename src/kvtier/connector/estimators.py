"""The moving estimates the cost model is made of (`cost_model`): each follows what it
measures as it changes, and none is poisoned by a sample that cannot be (a clock that
went backwards, a bug upstream)."""

from __future__ import annotations

import math
from collections import deque

# a step line (`StepLine`) is trusted from this many steps on
MIN_LINE_STEPS = 8


class MovingAverage:
    """An exponential moving average; None until its first sample."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.value: float | None = None

    def add(self, sample: float) -> None:
        if not math.isfinite(sample) or sample < 0:
            return  # a clock that went backwards, a bug upstream: never poison the estimate
        value = self.value
        self.value = sample if value is None else value + self.weight * (sample - value)


class WeightedMedian:
    """The median rate of the last `window` samples, each weighing as what it is per (a
    load's seconds past its round trip over its blocks: a load of 32 blocks says more of
    a block's time than one of 2, whose time is mostly the round trip's noise). A median,
    not a moving average: one load slowed by a busy engine (another request's prefill on
    every core) took a moving average from 2 to 18.5 ms a block in a bench_serving run,
    and the loads after it were declined, where a declined tier is measured again only
    by a probe. Averaged per sample, loads of a few blocks 25 ms off a 0.2 s round trip
    taught 12 ms a block where 32-block loads took 1 ms."""

    def __init__(self, window: int = 16) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        # the lowest rate with at least half the weight at or below it; None: no sample
        # (ranked once a load, not at every decision that reads it)
        self.value: float | None = None

    def add(self, amount: float, per: float) -> None:
        if not (math.isfinite(amount) and math.isfinite(per)) or amount < 0 or per <= 0:
            return  # a clock that went backwards, a bug upstream: never poison the estimate
        self._samples.append((amount / per, per))
        ranked = sorted(self._samples)
        half, weight = sum(w for _, w in ranked) / 2, 0.0
        for rate, w in ranked:
            weight += w
            if weight >= half:
                self.value = rate
                return
        self.value = ranked[-1][0]


class StepLine:
    """The engine's steps as a line, seconds = fixed + per_token x tokens, by least
    squares over the last `window` steps: what computing a token adds to a step (the
    slope), apart from what a step costs whatever it computes (the fixed part: the
    model's kernel launches, the scheduler's turn, sampling), which a load does not
    save (the step runs anyway, for the prompt's rest and the other requests).

    Why a line and not the average per token of whole steps: where a step is mostly
    fixed (a small model on a GPU), the average prices a recompute at several times its
    cost, and a load from a slow tier was offered where recomputing was faster. The
    slope is given (`per_token`) only where the steps say such a line describes them:
    at least MIN_LINE_STEPS steps, tokens that vary (the most at least twice the
    fewest), a fixed part >= 0 and a slope > 0. Steps that cost more than linearly in
    their tokens (vLLM's CPU build, whose prefill grows with the square of the tokens a
    step computes) give a negative fixed part, and too few or too alike steps no line:
    then None, and the caller keeps the average."""

    def __init__(self, window: int = 64) -> None:
        if window < 2:
            raise ValueError(f"step line window={window}; at least 2")
        self._steps: deque[tuple[float, float]] = deque(maxlen=window)
        self.per_token: float | None = None  # the slope, where trusted
        self.fixed: float | None = None  # the fixed part, where the slope is trusted

    def add(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        steps = self._steps
        steps.append((float(tokens), seconds))
        self.per_token = self.fixed = None
        n = len(steps)
        if n < MIN_LINE_STEPS or max(x for x, _ in steps) < 2 * min(x for x, _ in steps):
            return
        mean_x = sum(x for x, _ in steps) / n
        mean_y = sum(y for _, y in steps) / n
        var = sum((x - mean_x) ** 2 for x, _ in steps)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in steps) / var
        fixed = mean_y - slope * mean_x
        if slope > 0 and fixed >= 0:
            self.per_token, self.fixed = slope, fixed
