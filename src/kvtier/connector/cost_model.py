"""Load or recompute: what a load from each tier costs, against recomputing, measured.

A hit in a tier is only worth loading where the load is faster than computing those
tokens again. That break-even moves with the model, the link and the load of the
machine (llm-d measured it anywhere from under 2K to about 8.7K tokens), so it is not a
constant to configure but a comparison of two measured, moving estimates:

- per tier, what a load of n blocks takes: a round trip (Redis: every lookup's, as the
  background lookup thread times it) plus n times a block's transfer time (each finished
  load job's seconds less its round trip, over its blocks). The round trip is an
  exponential moving average (`smoothing` is a new sample's weight), the block's time
  the median of the last loads (`WeightedMedian`): they follow a tier as it slows down
  or recovers, the median once half the recent loads' blocks say so.
- what recomputing takes on this engine, per token, from the engine's own steps (the
  scheduler side times each step that computes tokens, start to output): what a token
  adds to a step, the slope of a line through the last steps, where they make one with
  a fixed part (`StepLine`: a load does not save what every step costs); else the
  moving average per token of whole steps, at the load the engine is under now.

`worth_loading(tier, n)` offers the n blocks only when the load is predicted faster.
The model decides per tier (the caller asks once per tier's run of blocks): a long
prefix may take its head from the CPU tier, which costs next to nothing, and recompute a
tail that only a slow Redis holds. Per tier is right because the costs are linear in
the blocks past one round trip: if a tier's run is not worth loading whole, no part of
it is (a shorter run saves less and pays the same round trip), while the CPU tier's head
is worth loading whatever the Redis tail costs.

Until a tier or the engine has been measured at all, hits are loaded (what kvtier did
before): the first load and the first computed prompt give the estimates. `mode="always"`
keeps loading every hit (the setting the crossover table measures against).

Where a round trip costs more than carrying a block (a slow link), a lookup reads the
first `prefetch_blocks` blocks it asks about whole (`kvtier.remote.prefetch`): carrying
them adds at most PREFETCH_SHARE of a round trip to the lookup, and their load then costs
none. The estimates follow: a load of blocks read whole costs nothing
(`load_seconds(..., prefetched=)`), and a request waits for a lookup as long as the load
after it would save, which for a run the lookup carries is the whole recompute; the
lookup itself is then predicted longer by the carrying (`lookup_seconds`).

A tier whose loads are declined is no longer measured by them, so a disk that was slow
for a while would be recomputed around for ever: every PROBE_EVERY-th run declined is
loaded anyway (`probe`), and its load refreshes the estimate. A probe costs at most a
recompute more than recomputing: a load predicted slower than a recompute is given up at
the recompute's time (`load_deadline_s`).

Bookkeeping only: no vLLM, no clock of its own (callers pass seconds in).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from kvtier.connector.estimators import MovingAverage, StepLine, WeightedMedian
from kvtier.validate import seconds

MODES = ("measured", "always")
MIN_STEP_BLOCKS = 2
# a load's deadline is never shorter: a Redis call slower than its default socket timeout
# (0.25 s) fails anyway, and a busy machine's load of a few blocks may take tens of ms
MIN_DEADLINE_S = 0.25
Mode = Literal["measured", "always"]
# every this many runs of a tier declined, one is loaded to measure the tier again
PROBE_EVERY = 32
# a lookup reads blocks whole while carrying them costs at most this share of its round
# trip, and at most MAX_PREFETCH_BLOCKS (`prefetch_blocks`)
PREFETCH_SHARE = 0.5
MAX_PREFETCH_BLOCKS = 128
# a request waits for a slow tier's lookup only where that lookup is predicted to take
# at most 1 / WAIT_MARGIN of what it saves (see `CostModel.lookup_too_slow`)
WAIT_MARGIN = 1.25


@dataclass(frozen=True)
class CostConfig:
    """`mode`: "measured" (load only what beats a recompute) or "always" (every hit);
    `smoothing`: a new sample's weight in the moving averages, in (0, 1];
    `unmeasured_wait_s`: how long a lookup may hold a request before the engine has
    computed anything (what it could save is not known yet; a Redis call that takes
    longer than the default socket timeout, 0.25 s, fails anyway);
    `sync_wait_s`: the longest the scheduler waits, in place, for a fast tier's answer
    to a request's first lookup (see `sync_wait_s` the method)."""

    mode: Mode = "measured"
    smoothing: float = 0.2
    unmeasured_wait_s: float = 0.25
    sync_wait_s: float = 0.002

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"load_decision={self.mode!r}; allowed: {', '.join(MODES)}")
        smoothing = self.smoothing
        if isinstance(smoothing, bool) or not isinstance(smoothing, int | float):
            raise ValueError(f"cost smoothing={smoothing!r}; a number in (0, 1]")
        if not 0 < smoothing <= 1:
            raise ValueError(f"cost smoothing={smoothing!r}; a number in (0, 1]")
        for name in ("unmeasured_wait_s", "sync_wait_s"):
            seconds(name, getattr(self, name))


class TierCost:
    """One tier's load cost: a round trip plus a transfer time per block."""

    def __init__(self, weight: float) -> None:
        self.round_trip = MovingAverage(weight)
        self.block_seconds = WeightedMedian()

    def seconds(self, num_blocks: int) -> float | None:
        """Predicted seconds to load `num_blocks`, or None if never measured."""
        rtt, per_block = self.round_trip.value, self.block_seconds.value
        if rtt is None and per_block is None:
            return None
        return (rtt or 0.0) + num_blocks * (per_block or 0.0)


class CostModel:
    """The estimates and the per-tier decisions (see the module docstring)."""

    def __init__(self, config: CostConfig, tokens_per_block: int) -> None:
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block={tokens_per_block}; at least 1")
        self.config = config
        self.tokens_per_block = tokens_per_block
        self.tiers: dict[str, TierCost] = {}
        self.token_seconds = MovingAverage(config.smoothing)  # recompute, per token
        self.step_line = StepLine()  # the same, apart from a step's fixed part
        # per tier: the share of requests whose first block asked of it was there
        self.lookup_hits: dict[str, MovingAverage] = {}
        # (tier, "load" | "recompute") -> blocks decided that way
        self.decisions: Counter[tuple[str, str]] = Counter()
        self._declined_runs: Counter[str] = Counter()  # since the tier's last probe

    def tier(self, name: str) -> TierCost:
        cost = self.tiers.get(name)
        if cost is None:
            cost = self.tiers[name] = TierCost(self.config.smoothing)
        return cost

    # --- what was measured ---------------------------------------------------

    def observe_round_trip(self, tier: str, seconds: float) -> None:
        self.tier(tier).round_trip.add(seconds)

    def observe_load(self, tier: str, num_blocks: int, seconds: float) -> None:
        """A finished load job: its time past one round trip is the blocks' transfer."""
        if num_blocks < 1:
            return
        cost = self.tier(tier)
        rtt = cost.round_trip.value or 0.0
        cost.block_seconds.add(max(seconds - rtt, 0.0), num_blocks)

    def observe_lookup(self, tier: str, found: bool, stored: bool = False) -> None:
        """The answer to a request's first lookup of `tier` (its first block not in a
        faster tier): whether the tier had it, so a run to load at all. `stored`: this
        engine stored that block in the tier itself (see `hit_share`)."""
        key = _share_key(tier, stored)
        share = self.lookup_hits.get(key)
        if share is None:  # from a prior of 1: one miss does not stop the waiting
            share = self.lookup_hits[key] = MovingAverage(self.config.smoothing)
            share.value = 1.0
        share.add(1.0 if found else 0.0)

    def hit_share(self, tier: str, stored: bool = False) -> float:
        """The moving share of requests whose first lookup of `tier` found a block, from
        a prior of 1 (a tier never asked is assumed to have what is asked: each miss
        then takes `smoothing` of the share away, so about ten in a row cut the wait
        tenfold). Two shares: of blocks this engine stored in the tier itself
        (`stored`), which come back unless evicted, and of the others, which only
        another engine may have stored. Kept as one, a conversation's returning turns
        did not wait for their history after a run of new conversations (twelve cold
        first turns took the share to a tenth), and new prompts waited for nothing
        after a run of returning ones."""
        share = self.lookup_hits.get(_share_key(tier, stored))
        return 1.0 if share is None or share.value is None else share.value

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """An engine step that computed `num_tokens` tokens in `seconds`. The average per
        token leaves out steps of fewer than MIN_STEP_BLOCKS blocks of tokens (decode
        steps, short prompts): their time is mostly the step's own, which recomputing a
        prefix does not add. The step line takes them: they say what the fixed part is."""
        self.step_line.add(num_tokens, seconds)
        if num_tokens >= MIN_STEP_BLOCKS * self.tokens_per_block:
            self.token_seconds.add(seconds / num_tokens)

    # --- predictions and decisions ------------------------------------------

    def recompute_seconds(self, num_blocks: int) -> float | None:
        """What recomputing `num_blocks` adds to the engine's steps (see the module
        docstring); None before a step that computed a few blocks was measured."""
        per_token = self.token_seconds.value
        if per_token is None:
            return None
        line = self.step_line.per_token
        return num_blocks * self.tokens_per_block * (per_token if line is None else line)

    def load_seconds(self, tier: str, num_blocks: int, prefetched: int = 0) -> float | None:
        """Predicted seconds to load `num_blocks` from `tier`, the first `prefetched` of
        which a lookup read whole (they cost nothing, and a load of only those no round
        trip); None where the tier was never measured."""
        cost = self.tiers.get(tier)
        if cost is None:
            return None
        if 0 < num_blocks <= prefetched:
            return 0.0
        return cost.seconds(num_blocks - max(prefetched, 0))

    def prefetch_blocks(self, tier: str) -> int:
        """How many blocks a lookup of `tier` reads whole (see the module docstring): as
        many as carrying costs at most PREFETCH_SHARE of a round trip; 0 until both are
        measured."""
        cost = self.tiers.get(tier)
        if cost is None:
            return 0
        rtt, per_block = cost.round_trip.value, cost.block_seconds.value
        if rtt is None or per_block is None:
            return 0
        if per_block <= 0:
            return MAX_PREFETCH_BLOCKS
        return min(int(PREFETCH_SHARE * rtt / per_block + 1e-9), MAX_PREFETCH_BLOCKS)

    def worth_loading(
        self,
        tier: str,
        num_blocks: int,
        prefetched: int = 0,
        queued: int = 0,
        saves: int | None = None,
    ) -> bool:
        """Whether loading `num_blocks` from `tier` (the first `prefetched` of them read
        whole by their lookup; behind `queued` blocks of loads already in flight, which
        it waits for) is predicted faster than recomputing them, or the `saves` blocks
        that a decline would recompute, where those are more (a run whose other blocks a
        faster tier holds); always in mode "always" or before either side was measured."""
        if self.config.mode == "always" or num_blocks < 1:
            return True
        if queued < 0:
            raise ValueError(f"queued blocks must be >= 0, got {queued}")
        if saves is not None and saves < num_blocks:
            raise ValueError(f"saves={saves} blocks; at least the {num_blocks} loaded")
        load = self.load_seconds(tier, num_blocks + queued, prefetched)
        recompute = self.recompute_seconds(num_blocks if saves is None else saves)
        if load is None or recompute is None:
            return True
        return load < recompute

    def decide(self, tier: str, num_blocks: int) -> bool:
        """`worth_loading` or a `probe`, counted (per tier, in blocks) for `/metrics`."""
        load = self.worth_loading(tier, num_blocks) or self.probe(tier)
        self.decisions[tier, "load" if load else "recompute"] += num_blocks
        return load

    def probe(self, tier: str) -> bool:
        """Called for a run of `tier` that is not worth loading: true for every
        PROBE_EVERY-th such run, which is loaded to measure the tier again (see the
        module docstring)."""
        self._declined_runs[tier] += 1
        if self._declined_runs[tier] < PROBE_EVERY:
            return False
        self._declined_runs[tier] = 0
        return True

    def probe_wait_s(self, tier: str) -> float:
        """How long a probe (see `probe`) may wait for its lookup: two round trips, and
        never less than MIN_DEADLINE_S."""
        cost = self.tiers.get(tier)
        rtt = None if cost is None else cost.round_trip.value
        return max(2 * (rtt or 0.0), MIN_DEADLINE_S)

    def wait_budget_s(
        self, tier: str, num_blocks: int, found: bool = False, stored: bool = False
    ) -> float:
        """The longest a request should wait for `tier`'s lookup of `num_blocks`: what the
        lookup is expected to save, what it could save at best (recomputing them, less
        loading them after it, `prefetch_blocks` of them carried by it) times the share
        of lookups that find anything (`hit_share`); 0 once loading them would not pay,
        `unmeasured_wait_s` before the engine computed anything.

        Expected, not best: with no reuse (every prompt new) a lookup that could save a
        whole prefill finds nothing, and waiting for it each time would make every
        request slower than with no cache at all. A workload whose prompts come back
        raises the share, and the requests wait again (the answers keep coming for the
        requests that did not wait: see `remote_runs`). `found`: the tier's answer for
        the first of the blocks is in, and it holds it: the saving is no longer a
        chance, and the share does not apply. `stored`: this engine stored the first of
        the blocks in the tier (the share of such lookups applies, see `hit_share`)."""
        if self.config.mode == "always":
            return math.inf
        recompute = self.recompute_seconds(num_blocks)
        if recompute is None:
            return self.config.unmeasured_wait_s
        # the load after the lookup: of the blocks it does not carry (`prefetch_blocks`)
        carried = self.carried_blocks(tier, num_blocks)
        load = self.load_seconds(tier, num_blocks, carried) or 0.0
        share = 1.0 if found else self.hit_share(tier, stored)
        return max(recompute - load, 0.0) * share

    def load_deadline_s(self, tier: str, num_blocks: int) -> float | None:
        """How long a load of `num_blocks` from `tier` may take before it is given up and
        the blocks recomputed: about what recomputing them costs, and never less than
        twice the load's own estimate or MIN_DEADLINE_S (a load offered as faster than a
        recompute must not be cut short by the noise of either estimate). A load
        predicted slower than the recompute (a `probe`) gets the recompute's time (or
        the floor). None before the engine was measured, and with mode "always"."""
        recompute = self.recompute_seconds(num_blocks)
        if self.config.mode == "always" or recompute is None:
            return None
        load = self.load_seconds(tier, num_blocks) or 0.0
        if load >= recompute:
            return max(recompute, MIN_DEADLINE_S)
        return max(recompute, 2 * load, MIN_DEADLINE_S)

    def sync_wait_s(
        self, tier: str, num_blocks: int, waited_s: float, stored: bool = False
    ) -> float:
        """How long the scheduler may wait in place for `tier`'s answer to a lookup of
        (at most) `num_blocks`, already waited on for `waited_s`; 0: not at all.

        vLLM's answer to a lookup not in yet is to ask again on a later step, which
        costs the request a whole step (tens of ms on a busy engine) even where the
        answer, a miss on a cold prompt most often, was a fraction of a millisecond
        away. Waiting in place costs every running request the same wait, so it is
        only done for a tier whose round trips are known (or, before the first one,
        assumed) to take no longer than `sync_wait_s`, and never longer than that, nor
        than what the lookup could save."""
        cap = self.config.sync_wait_s
        cost = self.tiers.get(tier)
        rtt = None if cost is None else cost.round_trip.value
        if cap <= 0 or (rtt is not None and rtt > cap):
            return 0.0
        budget = self.wait_budget_s(tier, num_blocks, stored=stored)
        return max(min(cap, budget - waited_s), 0.0)

    def lookup_seconds(self, tier: str, num_blocks: int) -> float | None:
        """Predicted seconds of `tier`'s lookup of `num_blocks`: a round trip, and the
        transfer of the blocks it carries (`prefetch_blocks`), each at a load's time
        per block: a carried block costs no load after the lookup, but the lookup takes
        longer by it (through a link adding 0.2 s, a lookup carrying 16 blocks of 256 KiB
        took 0.26 s where a miss took 0.21 s). None: no round trip measured."""
        cost = self.tiers.get(tier)
        rtt = None if cost is None else cost.round_trip.value
        if cost is None or rtt is None:
            return None
        return rtt + self.carried_blocks(tier, num_blocks) * (cost.block_seconds.value or 0.0)

    def carried_blocks(self, tier: str, num_blocks: int) -> int:
        """How many of a lookup's `num_blocks` it carries (`prefetch_blocks`)."""
        return min(max(num_blocks, 0), self.prefetch_blocks(tier))

    def lookup_too_slow(
        self,
        tier: str,
        num_blocks: int,
        found: bool = False,
        stored: bool = False,
        behind_s: float = 0.0,
        budget_s: float | None = None,
    ) -> bool:
        """Whether `tier`'s lookups take longer than they could save (`lookup_seconds`,
        times WAIT_MARGIN, against `wait_budget_s`): ask it in the background for later
        requests, and let this one go on without it. `behind_s`: how long a round trip
        that this lookup's questions wait behind has taken so far; the tier's round
        trips take at least that now. The estimate learns a round trip's time when it
        ends: a tier that stalls (or a first lookup that is slow, before any is
        measured) would hold every request that came meanwhile for its whole budget.
        `budget_s`: `wait_budget_s` of the same lookup, where the caller has it already.

        Why a margin: near the break-even a wait gains nothing on average, and what the
        estimates leave out only adds to a wait (the engine step that runs the load,
        reading the carried values, the copy into the CPU tier: 0.03 s in all after a
        lookup's answer on the 8-layer model), while the recompute estimate, seconds per
        token of whole steps, runs high where steps attend to cached tokens (17-19 ms a
        block where recomputing a 16-block history saved 15.6). One at a time through a
        link adding 0.2 s, second turns waited 0.25 s to save 0.25 s and took 1.08-1.16x
        vLLM alone's time to their first token. The margin only decides whether to wait:
        a request that waits keeps its whole budget."""
        seconds = self.lookup_seconds(tier, num_blocks)
        if behind_s > 0:
            seconds = max(seconds or 0.0, behind_s)
        if budget_s is None:
            budget_s = self.wait_budget_s(tier, num_blocks, found, stored)
        return seconds is not None and seconds * WAIT_MARGIN > budget_s

    def gauges(self) -> dict[tuple[str, str], float]:
        """The estimates, by (metric key, tier), for `/metrics`."""
        out: dict[tuple[str, str], float] = {}
        for name, cost in self.tiers.items():
            if cost.round_trip.value is not None:
                out["cost_round_trip_seconds", name] = cost.round_trip.value
            if cost.block_seconds.value is not None:
                out["cost_load_block_seconds", name] = cost.block_seconds.value
        for name, share in self.lookup_hits.items():
            if share.value is not None:
                out["cost_lookup_hit_share", name] = share.value
        per_block = self.recompute_seconds(1)
        if per_block is not None:
            out["cost_recompute_block_seconds", "engine"] = per_block
            # 0 where the estimate is the average per token (no fixed part taken out)
            out["cost_step_fixed_seconds", "engine"] = self.step_line.fixed or 0.0
        return out


def _share_key(tier: str, stored: bool) -> str:
    """The hit share's key (and its `/metrics` label): `tier`, or `<tier>_stored`."""
    return f"{tier}_stored" if stored else tier
