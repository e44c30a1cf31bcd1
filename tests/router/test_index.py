"""The block index against a plain model of reference counts (hypothesis stateful),
plus the cases that the model states outright."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.router.index import BlockIndex, int_form
from kvtier.router.tiers import Tier, TierEvent

ENGINES = ("a", "b", "c")
HASHES = tuple(bytes([i]) * 32 for i in range(6))


def test_counts_not_sets() -> None:
    index = BlockIndex()
    h = HASHES[0]
    index.stored("a", Tier.GPU, [h, h])
    index.removed("a", Tier.GPU, [h])
    assert index.best_tier("a", h) is Tier.GPU
    index.removed("a", Tier.GPU, [h])
    assert index.best_tier("a", h) is None
    index.removed("a", Tier.GPU, [h])  # a removal of nothing is ignored
    index.stored("a", Tier.GPU, [h])
    assert index.best_tier("a", h) is Tier.GPU


def test_the_prefix_stops_at_the_first_block_the_engine_cannot_serve() -> None:
    index = BlockIndex()
    index.stored("a", Tier.CPU, HASHES[:2])
    index.stored("a", Tier.GPU, HASHES[:1])
    index.stored("a", Tier.GPU, HASHES[3:4])
    assert index.prefix_tiers("a", list(HASHES)) == [Tier.GPU, Tier.CPU]


def test_shared_blocks_serve_every_engine_until_their_last_announcer_goes() -> None:
    index = BlockIndex()
    index.stored("a", Tier.SHARED, HASHES[:1])
    index.stored("b", Tier.SHARED, HASHES[:1])
    assert index.prefix_tiers("c", list(HASHES)) == [Tier.SHARED]
    index.clear("a")  # a cache reset leaves Redis alone
    assert index.best_tier("c", HASHES[0]) is Tier.SHARED
    index.drop_engine("a")
    assert index.best_tier("c", HASHES[0]) is Tier.SHARED
    index.drop_engine("b")
    assert index.best_tier("c", HASHES[0]) is None


def test_an_engine_publishing_int_hashes_is_asked_in_int_form() -> None:
    index = BlockIndex()
    index.stored("a", Tier.GPU, [int_form(h) for h in HASHES[:2]])
    assert index.prefix_tiers("a", list(HASHES)) == [Tier.GPU, Tier.GPU]
    assert index.prefix_tiers("b", list(HASHES)) == []


def test_apply_refuses_what_it_cannot_place() -> None:
    index = BlockIndex()
    index.apply("a", TierEvent("stored", Tier.DISK, HASHES[:1]))
    assert index.best_tier("a", HASHES[0]) is Tier.DISK
    for bad in (TierEvent("stored"), TierEvent("moved", Tier.GPU)):
        try:
            index.apply("a", bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} was accepted")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_routed_prompt_counts_as_in_the_pool_until_an_event_names_it() -> None:
    clock = Clock()
    index = BlockIndex(clock)
    index.stored("a", Tier.CPU, HASHES[:1])
    index.routed("a", HASHES[:3], ttl_s=10.0)
    # the engine's events are late: its turn's blocks count as in its pool
    assert index.prefix_tiers("a", list(HASHES)) == [Tier.GPU] * 3
    assert index.prefix_tiers("b", list(HASHES)) == []
    index.removed("a", Tier.GPU, HASHES[1:2])  # the events speak: the guess ends
    assert index.prefix_tiers("a", list(HASHES)) == [Tier.GPU]
    clock.now = 10.5  # no event for the rest in ttl_s: the engine may have dropped it
    assert index.prefix_tiers("a", list(HASHES)) == [Tier.CPU]


def test_a_reset_or_a_lost_engine_ends_the_guesses_and_zero_makes_none() -> None:
    index = BlockIndex(Clock())
    index.routed("a", HASHES[:2], ttl_s=10.0)
    index.clear("a")
    assert index.prefix_tiers("a", list(HASHES)) == []
    index.routed("a", HASHES[:2], ttl_s=10.0)
    index.drop_engine("a")
    assert index.prefix_tiers("a", list(HASHES)) == []
    index.routed("a", HASHES[:2], ttl_s=0.0)
    assert index.prefix_tiers("a", list(HASHES)) == []


def test_a_rebuild_forgets_the_announcements_and_keeps_the_guesses() -> None:
    index = BlockIndex(Clock())
    index.stored("a", Tier.CPU, HASHES[2:])
    index.routed("a", HASHES[:2], ttl_s=10.0)
    index.drop_engine("a", keep_routed=True)
    assert index.held_blocks("a") == 0
    assert index.prefix_tiers("a", list(HASHES)) == [Tier.GPU, Tier.GPU]


def test_an_int_hash_event_ends_the_guess_of_its_block() -> None:
    index = BlockIndex(Clock())
    index.routed("a", HASHES[:2], ttl_s=10.0)
    index.stored("a", Tier.CPU, [int_form(HASHES[0])])  # an engine that publishes ints
    assert index.prefix_tiers("a", list(HASHES)) == [Tier.CPU, Tier.GPU]


class IndexMachine(RuleBasedStateMachine):
    """Any sequence of stores, removals, clears, drops, routed prompts and time passing:
    the index answers as a counter of (engine, hash, tier) announcements and a table of
    routed guesses (each until an event names its block, a reset or drop, or its
    time runs out; a rebuild from the replay buffer keeps them) do."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.index = BlockIndex(self.clock)
        self.model: Counter[tuple[str, bytes, Tier]] = Counter()
        self.routed: dict[tuple[str, bytes], float] = {}

    @rule(
        engine=st.sampled_from(ENGINES),
        hashes=st.lists(st.sampled_from(HASHES), max_size=4),
        ttl=st.sampled_from([0.0, 1.0, 5.0]),
    )
    def route(self, engine: str, hashes: list[bytes], ttl: float) -> None:
        self.index.routed(engine, hashes, ttl)
        if ttl > 0:
            for h in hashes:
                self.routed[(engine, h)] = self.clock.now + ttl

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0]))
    def wait(self, seconds: float) -> None:
        self.clock.now += seconds

    def _named(self, engine: str, hashes: list[bytes]) -> None:
        for h in hashes:
            self.routed.pop((engine, h), None)

    @rule(
        engine=st.sampled_from(ENGINES),
        tier=st.sampled_from(list(Tier)),
        hashes=st.lists(st.sampled_from(HASHES), max_size=4),
    )
    def store(self, engine: str, tier: Tier, hashes: list[bytes]) -> None:
        self.index.apply(engine, TierEvent("stored", tier, tuple(hashes)))
        self._named(engine, hashes)
        for h in hashes:
            self.model[(engine, h, tier)] += 1

    @rule(
        engine=st.sampled_from(ENGINES),
        tier=st.sampled_from(list(Tier)),
        hashes=st.lists(st.sampled_from(HASHES), max_size=4),
    )
    def remove(self, engine: str, tier: Tier, hashes: list[bytes]) -> None:
        self.index.apply(engine, TierEvent("removed", tier, tuple(hashes)))
        self._named(engine, hashes)
        for h in hashes:
            if self.model[(engine, h, tier)] > 0:
                self.model[(engine, h, tier)] -= 1

    @rule(engine=st.sampled_from(ENGINES))
    def clear(self, engine: str) -> None:
        self.index.apply(engine, TierEvent("cleared"))
        self.routed = {k: v for k, v in self.routed.items() if k[0] != engine}
        for key in list(self.model):
            if key[0] == engine and key[2] is not Tier.SHARED:
                self.model[key] = 0

    @rule(engine=st.sampled_from(ENGINES))
    def drop(self, engine: str) -> None:
        self.index.drop_engine(engine)
        self.routed = {k: v for k, v in self.routed.items() if k[0] != engine}
        for key in list(self.model):
            if key[0] == engine:
                self.model[key] = 0

    @rule(engine=st.sampled_from(ENGINES))
    def rebuild(self, engine: str) -> None:
        self.index.drop_engine(engine, keep_routed=True)
        for key in list(self.model):
            if key[0] == engine:
                self.model[key] = 0

    def expected(self, engine: str, h: bytes) -> Tier | None:
        own = [t for (e, b, t), n in self.model.items() if n > 0 and e == engine and b == h]
        if own:
            return min(own)
        shared = any(n > 0 and b == h and t is Tier.SHARED for (_, b, t), n in self.model.items())
        return Tier.SHARED if shared else None

    @invariant()
    def agrees(self) -> None:
        for engine in ENGINES:
            for h in HASHES:
                assert self.index.best_tier(engine, h) == self.expected(engine, h), (engine, h)
            held = {b for (e, b, _), n in self.model.items() if n > 0 and e == engine}
            assert self.index.held_blocks(engine) == len(held)
            prefix = self.index.prefix_tiers(engine, list(HASHES))
            wanted = []
            for h in HASHES:
                tier = self.expected(engine, h)
                if self.routed.get((engine, h), -1.0) >= self.clock.now:
                    tier = Tier.GPU  # routed moments ago: in the pool by now
                if tier is None:
                    break
                wanted.append(tier)
            assert prefix == wanted
        shared = {b for (_, b, t), n in self.model.items() if n > 0 and t is Tier.SHARED}
        assert self.index.shared_blocks() == len(shared)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
