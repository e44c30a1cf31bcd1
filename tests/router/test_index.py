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


class IndexMachine(RuleBasedStateMachine):
    """Any sequence of stores, removals, clears and drops: the index answers as a
    counter of (engine, hash, tier) announcements does."""

    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex()
        self.model: Counter[tuple[str, bytes, Tier]] = Counter()

    @rule(
        engine=st.sampled_from(ENGINES),
        tier=st.sampled_from(list(Tier)),
        hashes=st.lists(st.sampled_from(HASHES), max_size=4),
    )
    def store(self, engine: str, tier: Tier, hashes: list[bytes]) -> None:
        self.index.apply(engine, TierEvent("stored", tier, tuple(hashes)))
        for h in hashes:
            self.model[(engine, h, tier)] += 1

    @rule(
        engine=st.sampled_from(ENGINES),
        tier=st.sampled_from(list(Tier)),
        hashes=st.lists(st.sampled_from(HASHES), max_size=4),
    )
    def remove(self, engine: str, tier: Tier, hashes: list[bytes]) -> None:
        self.index.apply(engine, TierEvent("removed", tier, tuple(hashes)))
        for h in hashes:
            if self.model[(engine, h, tier)] > 0:
                self.model[(engine, h, tier)] -= 1

    @rule(engine=st.sampled_from(ENGINES))
    def clear(self, engine: str) -> None:
        self.index.apply(engine, TierEvent("cleared"))
        for key in list(self.model):
            if key[0] == engine and key[2] is not Tier.SHARED:
                self.model[key] = 0

    @rule(engine=st.sampled_from(ENGINES))
    def drop(self, engine: str) -> None:
        self.index.drop_engine(engine)
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
                if tier is None:
                    break
                wanted.append(tier)
            assert prefix == wanted
        shared = {b for (_, b, t), n in self.model.items() if n > 0 and t is Tier.SHARED}
        assert self.index.shared_blocks() == len(shared)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
