"""The load-or-recompute model: measured, moving estimates and the decisions they give."""

from __future__ import annotations

import math

import pytest

from kvtier.connector.cost_model import (
    MAX_PREFETCH_BLOCKS,
    MIN_DEADLINE_S,
    PROBE_EVERY,
    WAIT_MARGIN,
    CostConfig,
    CostModel,
)

TOKENS = 32  # per block


def model(mode: str = "measured") -> CostModel:
    return CostModel(CostConfig(mode=mode), TOKENS)  # type: ignore[arg-type]


def test_before_anything_is_measured_every_hit_is_loaded() -> None:
    cost = model()
    assert cost.worth_loading("redis", 8)
    cost.observe_round_trip("redis", 0.2)
    assert cost.worth_loading("redis", 8)  # the engine's recompute not measured yet
    assert cost.wait_budget_s("redis", 8) == CostConfig().unmeasured_wait_s


def test_a_run_is_loaded_only_past_the_break_even() -> None:
    cost = model()
    cost.observe_step(TOKENS * 10, 0.1)  # 10 ms per block to recompute
    cost.observe_round_trip("redis", 0.2)
    cost.observe_load("redis", 100, 0.2 + 100 * 0.002)  # 2 ms per block past the round trip
    assert cost.load_seconds("redis", 10) == pytest.approx(0.22)
    assert cost.recompute_seconds(10) == pytest.approx(0.1)
    # break-even: 0.2 + 0.002 n < 0.01 n, so n > 25
    assert not cost.worth_loading("redis", 25)
    assert cost.worth_loading("redis", 26)
    assert cost.worth_loading("cpu", 1)  # a tier never measured: loaded


def test_the_estimates_follow_a_tier_that_slows_down_and_recovers() -> None:
    cost = model()
    cost.observe_step(TOKENS * 100, 1.0)  # 10 ms per block
    for _ in range(30):
        cost.observe_round_trip("redis", 0.001)
    assert cost.worth_loading("redis", 4)
    for _ in range(30):
        cost.observe_round_trip("redis", 0.5)  # the link slows: recompute instead
    assert not cost.worth_loading("redis", 4)
    for _ in range(30):
        cost.observe_round_trip("redis", 0.001)  # and recovers
    assert cost.worth_loading("redis", 4)


def test_decisions_are_counted_per_tier_in_blocks() -> None:
    cost = model()
    cost.observe_step(TOKENS * 2, 0.002)
    cost.observe_round_trip("redis", 1.0)
    assert not cost.decide("redis", 6)
    cost.observe_round_trip("cpu", 0.0)
    assert cost.decide("cpu", 3)
    assert cost.decisions == {("redis", "recompute"): 6, ("cpu", "load"): 3}
    gauges = cost.gauges()
    assert gauges["cost_round_trip_seconds", "redis"] == 1.0
    assert gauges["cost_recompute_block_seconds", "engine"] == pytest.approx(0.001)


def test_always_loads_whatever_the_estimates() -> None:
    cost = model("always")
    cost.observe_step(TOKENS * 2, 0.002)
    cost.observe_round_trip("redis", 10.0)
    assert cost.worth_loading("redis", 1)
    assert cost.wait_budget_s("redis", 1) == math.inf
    assert not cost.lookup_too_slow("redis", 1)


def test_a_lookup_is_waited_for_no_longer_than_it_could_save() -> None:
    cost = model()
    cost.observe_step(TOKENS * 10, 1.0)  # 0.1 s per block
    cost.observe_round_trip("redis", 0.05)
    assert cost.wait_budget_s("redis", 4) == pytest.approx(0.4 - 0.05)
    assert not cost.lookup_too_slow("redis", 4)
    cost.observe_round_trip("redis", 50.0)  # one very slow answer moves the average past it
    assert cost.lookup_too_slow("redis", 4)


def test_samples_that_cannot_be_times_are_ignored() -> None:
    cost = model()
    cost.observe_round_trip("redis", -1.0)
    cost.observe_round_trip("redis", math.nan)
    cost.observe_step(0, 1.0)
    cost.observe_step(TOKENS, 1.0)  # a short step: mostly its own overhead, left out
    cost.observe_load("redis", 0, 1.0)
    assert cost.load_seconds("redis", 1) is None and cost.recompute_seconds(1) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "sometimes"}, "load_decision='sometimes'; allowed: measured, always"),
        ({"smoothing": 0}, "smoothing=0; a number in \\(0, 1\\]"),
        ({"smoothing": "fast"}, "smoothing='fast'; a number in \\(0, 1\\]"),
        ({"unmeasured_wait_s": -1}, "unmeasured_wait_s=-1; a finite number of seconds >= 0"),
        ({"sync_wait_s": math.inf}, "sync_wait_s=inf; a finite number of seconds >= 0"),
        ({"sync_wait_s": "1ms"}, "sync_wait_s='1ms'; a finite number of seconds >= 0"),
    ],
)
def test_bad_settings_name_the_value_and_what_is_allowed(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        CostConfig(**fields)  # type: ignore[arg-type]


def test_a_load_may_take_about_a_recompute_before_it_is_given_up() -> None:
    cost = model()
    assert cost.load_deadline_s("redis", 10) is None  # nothing measured: no deadline
    cost.observe_step(TOKENS * 10, 1.0)  # 0.1 s a block
    assert cost.load_deadline_s("redis", 10) == pytest.approx(1.0)
    assert cost.load_deadline_s("redis", 0) == MIN_DEADLINE_S  # never below the floor
    cost.observe_round_trip("redis", 0.8)  # a load estimated close: twice its estimate
    assert cost.load_deadline_s("redis", 10) == pytest.approx(1.6)
    cost.observe_round_trip("redis", 30.0)  # slower than the recompute: only a probe
    assert cost.load_deadline_s("redis", 10) == pytest.approx(1.0)  # loads it; no longer
    assert model("always").load_deadline_s("redis", 10) is None


def test_a_tier_recomputed_around_is_loaded_once_in_a_while_to_measure_it_again() -> None:
    cost = model()
    cost.observe_step(TOKENS * 10, 0.01)  # 1 ms per block
    cost.observe_load("disk", 10, 1.0)  # 100 ms per block: recompute
    decisions = [cost.decide("disk", 2) for _ in range(2 * PROBE_EVERY)]
    assert [i for i, load in enumerate(decisions) if load] == [
        PROBE_EVERY - 1,
        2 * PROBE_EVERY - 1,
    ]
    assert cost.decisions == {
        ("disk", "load"): 4,
        ("disk", "recompute"): 4 * PROBE_EVERY - 4,
    }
    for _ in range(30):
        cost.observe_load("disk", 10, 0.001)  # the probes' loads: the disk recovered
    assert cost.decide("disk", 2)


def test_only_a_fast_tier_is_waited_for_in_place_and_never_past_what_it_could_save() -> None:
    cost = model()
    cap = CostConfig().sync_wait_s
    assert cost.sync_wait_s("redis", 8, 0.0) == cap  # no round trip seen yet: assumed fast
    cost.observe_step(TOKENS * 10, 0.01)  # 1 ms a block to recompute
    cost.observe_round_trip("redis", cap / 4)
    assert cost.sync_wait_s("redis", 8, 0.0) == cap  # could save up to 8 ms
    assert cost.sync_wait_s("redis", 1, 0.0) == pytest.approx(1e-3 - cap / 4)
    assert cost.sync_wait_s("redis", 8, 1.0) == 0.0  # waited longer than it could save
    cost.observe_round_trip("redis", 1.0)  # slowed down: deferring beats waiting in place
    assert cost.sync_wait_s("redis", 8, 0.0) == 0.0
    off = CostModel(CostConfig(sync_wait_s=0), TOKENS)
    assert off.sync_wait_s("redis", 8, 0.0) == 0.0


def test_a_lookup_is_waited_for_as_long_as_it_is_expected_to_save() -> None:
    cost = model()
    cost.observe_step(TOKENS * 10, 0.1)  # 10 ms a block: 10 blocks could save 0.1 s
    assert cost.hit_share("redis") == 1.0
    assert cost.wait_budget_s("redis", 10) == pytest.approx(0.1)
    for _ in range(10):  # no reuse: every first lookup misses
        cost.observe_lookup("redis", False)
    assert cost.hit_share("redis") == pytest.approx(0.8**10)
    assert cost.wait_budget_s("redis", 10) == pytest.approx(0.1 * 0.8**10)
    cost.observe_round_trip("redis", 0.02)
    assert cost.lookup_too_slow("redis", 10)  # 20 ms to expect to save about 11
    cost.observe_lookup("redis", True)  # prompts come back: the wait grows again
    assert cost.hit_share("redis") == pytest.approx(0.8**11 + 0.2)
    assert cost.lookup_too_slow("redis", 10)  # 20 ms to save 22: inside the margin
    cost.observe_lookup("redis", True)
    assert not cost.lookup_too_slow("redis", 10)  # 20 ms to save 37
    assert cost.gauges()["cost_lookup_hit_share", "redis"] == cost.hit_share("redis")


def test_a_load_behind_others_in_flight_waits_for_them() -> None:
    cost = model()
    cost.observe_step(TOKENS * 10, 0.1)  # 10 ms a block
    cost.observe_load("disk", 10, 0.05)  # 5 ms a block
    assert cost.worth_loading("disk", 10)  # 50 ms against 100
    assert cost.worth_loading("disk", 10, queued=9)  # 95 ms
    assert not cost.worth_loading("disk", 10, queued=11)  # 105 ms
    with pytest.raises(ValueError, match="queued blocks must be >= 0, got -1"):
        cost.worth_loading("disk", 10, queued=-1)


def test_a_load_that_saves_blocks_a_faster_tier_holds_is_weighed_against_them_all() -> None:
    """A run of ten from its first slow block, six of which a faster tier holds: loading
    the four slow ones saves recomputing all ten (declined at its first slow block, vLLM
    recomputes from there on)."""
    cost = model()
    cost.observe_step(TOKENS * 10, 0.1)  # 10 ms a block
    cost.observe_load("disk", 10, 0.2)  # 20 ms a block
    assert not cost.worth_loading("disk", 4)  # 80 ms against 40
    assert cost.worth_loading("disk", 4, saves=10)  # against 100
    assert not cost.worth_loading("disk", 4, queued=2, saves=10)  # 120 ms
    with pytest.raises(ValueError, match="saves=3 blocks; at least the 4 loaded"):
        cost.worth_loading("disk", 4, saves=3)


def test_a_lookup_whose_first_block_was_found_is_waited_for_its_whole_saving() -> None:
    cost = model()
    cost.observe_step(TOKENS * 10, 0.1)
    for _ in range(10):
        cost.observe_lookup("redis", False)
    cost.observe_round_trip("redis", 0.02)
    assert cost.lookup_too_slow("redis", 10)  # a chance of a hit: not worth 20 ms
    assert cost.wait_budget_s("redis", 10, found=True) == pytest.approx(0.08)
    assert not cost.lookup_too_slow("redis", 10, found=True)  # a hit: worth it
    # a caller that has the budget passes it, and is judged by it
    budget = cost.wait_budget_s("redis", 10, found=True)
    assert not cost.lookup_too_slow("redis", 10, budget_s=budget)
    assert cost.lookup_too_slow("redis", 10, found=True, budget_s=0.02)  # 25 ms against 20


def test_a_lookup_carries_blocks_while_carrying_them_costs_under_half_its_round_trip() -> None:
    cost = model()
    assert cost.prefetch_blocks("redis") == 0  # nothing measured: headers only
    cost.observe_round_trip("redis", 0.2)
    assert cost.prefetch_blocks("redis") == 0  # a block's carrying not measured yet
    cost.observe_load("redis", 10, 0.2 + 10 * 0.004)  # 4 ms a block past the round trip
    assert cost.prefetch_blocks("redis") == 25  # 25 * 4 ms = half of 0.2 s
    assert cost.load_seconds("redis", 5) == pytest.approx(0.22)
    fast = model()
    fast.observe_round_trip("redis", 0.001)
    fast.observe_load("redis", 10, 0.001 + 10 * 0.004)
    assert fast.prefetch_blocks("redis") == 0  # a round trip is cheaper than a block
    free = model()
    free.observe_round_trip("redis", 0.2)
    free.observe_load("redis", 10, 0.1)  # faster than a round trip: no transfer seen
    assert free.prefetch_blocks("redis") == MAX_PREFETCH_BLOCKS


def test_blocks_a_lookup_carried_load_for_nothing() -> None:
    cost = model()
    cost.observe_step(TOKENS * 10, 0.1)  # 10 ms a block to recompute
    cost.observe_round_trip("redis", 0.2)
    cost.observe_load("redis", 10, 0.2 + 10 * 0.002)
    assert cost.load_seconds("redis", 16, prefetched=16) == 0.0
    assert cost.load_seconds("redis", 16, prefetched=10) == pytest.approx(0.2 + 6 * 0.002)
    assert not cost.worth_loading("redis", 16)  # 0.232 s against 0.16 s
    assert cost.worth_loading("redis", 16, prefetched=16)
    assert not cost.worth_loading("redis", 16, prefetched=10)  # a round trip all the same


def test_a_lookup_that_carries_its_run_is_waited_for_as_long_as_the_recompute() -> None:
    """Through a link adding 0.2 s, a 16-block history that recomputes in 0.32 s: waiting
    for a lookup and then a load (0.4 s) loses, waiting for a lookup that carries the
    blocks (0.2 s) wins."""
    cost = model()
    cost.observe_step(TOKENS * 10, 0.2)  # 20 ms a block
    cost.observe_round_trip("redis", 0.2)
    assert cost.lookup_too_slow("redis", 16)  # 0.32 - 0.2 s to save: not worth 0.2 s
    cost.observe_load("redis", 16, 0.2 + 16 * 0.001)
    assert cost.prefetch_blocks("redis") == 100
    assert cost.wait_budget_s("redis", 16) == pytest.approx(0.32)
    assert not cost.lookup_too_slow("redis", 16)
    # past what a lookup carries, the rest costs a round trip of its own
    assert cost.wait_budget_s("redis", 116) == pytest.approx(116 * 0.02 - 0.2 - 16 * 0.001)


def test_a_lookup_that_carries_blocks_takes_longer_by_their_transfer() -> None:
    """Through a link adding 0.2 s, a lookup carrying a 16-block history took 0.26 s
    where a miss took 0.21 s: a history that recomputes in 0.22 s is not worth it, though
    the round trip alone is shorter (a second turn waited and lost ~0.05 s)."""
    cost = model()
    cost.observe_step(TOKENS * 10, 0.14)  # 14 ms a block: 16 of them in 0.224 s
    cost.observe_round_trip("redis", 0.2)
    cost.observe_load("redis", 16, 0.2 + 16 * 0.003)  # 3 ms a block past the round trip
    assert cost.prefetch_blocks("redis") == 33  # the lookup carries all 16
    assert cost.lookup_seconds("redis", 16) == pytest.approx(0.2 + 16 * 0.003)
    assert cost.wait_budget_s("redis", 16) == pytest.approx(0.224)  # carried: no load after
    assert cost.lookup_too_slow("redis", 16)  # 0.248 s to save 0.224 s
    assert cost.lookup_seconds("redis", 60) == pytest.approx(0.2 + 33 * 0.003)
    assert not cost.lookup_too_slow("redis", 60)  # 0.299 s to save 0.84 - 0.281 s
    assert model().lookup_seconds("redis", 16) is None  # nothing measured


def test_a_lookup_is_waited_for_only_where_it_saves_a_margin_more_than_it_takes() -> None:
    """Near the break-even a wait gains nothing on average and what the estimates leave
    out (the load's engine step, the copy into the CPU tier) only adds to it: a lookup
    that carries its run in 0.216 s is not waited for to save 0.24 s, and one of 0.22 s
    is to save 0.3 s (WAIT_MARGIN)."""
    cost = model()
    cost.observe_step(TOKENS * 10, 0.15)  # 15 ms a block
    cost.observe_round_trip("redis", 0.2)
    cost.observe_load("redis", 16, 0.2 + 16 * 0.001)  # 1 ms a block: 100 carried
    assert cost.lookup_seconds("redis", 16) == pytest.approx(0.216)
    assert cost.wait_budget_s("redis", 16) == pytest.approx(0.24)
    assert 0.216 < 0.24 < 0.216 * WAIT_MARGIN
    assert cost.lookup_too_slow("redis", 16)
    assert cost.wait_budget_s("redis", 20) == pytest.approx(0.3)
    assert not cost.lookup_too_slow("redis", 20)


def test_a_round_trip_still_on_its_way_is_a_floor_on_the_lookup() -> None:
    """A lookup queued behind a round trip that has taken 0.35 s so far is not waited
    for to save 0.4 s, whatever the round trips measured before it (or none) say."""
    cost = model()
    cost.observe_step(TOKENS * 10, 1.0)  # 0.1 s a block
    assert not cost.lookup_too_slow("redis", 4, behind_s=0.3)  # 0.375 s to save 0.4
    assert cost.lookup_too_slow("redis", 4, behind_s=0.35)  # no round trip measured
    cost.observe_round_trip("redis", 0.001)
    assert not cost.lookup_too_slow("redis", 4)
    assert cost.lookup_too_slow("redis", 4, behind_s=0.35)
    slower = model()
    slower.observe_step(TOKENS * 10, 1.0)
    slower.observe_round_trip("redis", 0.5)  # measured slower still: the estimate counts
    assert slower.lookup_too_slow("redis", 4, behind_s=0.01)


def test_lookups_of_blocks_stored_here_and_of_others_have_their_own_hit_shares() -> None:
    cost = model()
    cost.observe_step(TOKENS * 10, 1.0)  # 0.1 s a block
    cost.observe_round_trip("redis", 0.05)
    for _ in range(10):
        cost.observe_lookup("redis", False)  # new prompts
    cost.observe_lookup("redis", True, stored=True)
    assert cost.hit_share("redis") == pytest.approx(0.8**10)
    assert cost.hit_share("redis", stored=True) == 1.0
    assert cost.lookup_too_slow("redis", 4)  # 0.35 s at best, times 0.11
    assert not cost.lookup_too_slow("redis", 4, stored=True)
    assert cost.wait_budget_s("redis", 4, stored=True) == pytest.approx(0.35)
    gauges = cost.gauges()
    assert gauges["cost_lookup_hit_share", "redis_stored"] == 1.0


def test_a_blocks_transfer_time_weighs_each_load_by_its_blocks() -> None:
    """Loads of a few blocks are mostly the round trip's noise: 25 ms over a 0.2 s round
    trip on 2 blocks is no sign that 32 blocks take 0.4 s more."""
    cost = model()
    cost.observe_round_trip("redis", 0.2)
    cost.observe_load("redis", 2, 0.2 + 0.025)
    for _ in range(3):
        cost.observe_load("redis", 32, 0.2 + 32 * 0.001)
    per_block = cost.tiers["redis"].block_seconds.value
    assert per_block is not None and per_block < 0.003  # per load averaged: over 0.005
    cost.observe_load("redis", 0, 5.0)  # no blocks: no sample
    cost.observe_load("redis", 4, float("nan"))
    assert cost.tiers["redis"].block_seconds.value == per_block


def test_one_slow_load_does_not_move_a_blocks_time_but_a_slower_tier_does() -> None:
    """A load slowed by a busy engine is one sample of the last loads' median; a tier
    that slows down moves it once half the recent loads' blocks say so."""
    cost = model()
    cost.observe_round_trip("redis", 0.2)
    for _ in range(6):
        cost.observe_load("redis", 16, 0.2 + 16 * 0.002)
    cost.observe_load("redis", 32, 0.2 + 1.0)  # 31 ms a block, once
    assert cost.tiers["redis"].block_seconds.value == pytest.approx(0.002)
    for _ in range(5):
        cost.observe_load("redis", 16, 0.2 + 16 * 0.03)
    assert cost.tiers["redis"].block_seconds.value == pytest.approx(0.03)
