"""The routing decision on its own: tiers weigh, load weighs, ties take turns."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier.router.scoring import Chooser, Weights
from kvtier.router.tiers import Tier

G, C, D, S = Tier.GPU, Tier.CPU, Tier.DISK, Tier.SHARED


def choose(
    chooser: Chooser,
    prefixes: dict[str, Sequence[Tier]],
    load: dict[str, int] | None = None,
    blocks: int = 4,
) -> str:
    loads = load or {}
    decision = chooser.choose(
        list(prefixes), blocks, lambda e: prefixes[e], lambda e: loads.get(e, 0)
    )
    return decision.engine


def test_the_longest_prefix_wins_and_tiers_weigh() -> None:
    c = Chooser()
    assert choose(c, {"a": [G], "b": [G, G]}) == "b"
    assert choose(c, {"a": [G, G], "b": [C, C]}) == "a"
    # a longer prefix on CPU beats a shorter one in the pool
    assert choose(c, {"a": [G], "b": [C, C]}) == "b"
    assert choose(c, {"a": [D, D], "b": [S, S]}) == "a"


def test_load_weighs_against_the_prefix() -> None:
    c = Chooser(weights=Weights(load=0.1))
    assert choose(c, {"a": [G], "b": []}, {"a": 1}) == "a"  # 0.25 - 0.1 > 0
    assert choose(c, {"a": [G], "b": []}, {"a": 3}) == "b"  # 0.25 - 0.3 < 0


def test_ties_go_to_the_least_loaded_then_take_turns() -> None:
    c = Chooser()
    assert choose(c, {"a": [], "b": [], "c": []}, {"a": 1, "c": 1}) == "b"
    turns = [choose(c, {"a": [], "b": [], "c": []}) for _ in range(4)]
    assert sorted(turns[:3]) == ["a", "b", "c"] and turns[3] == turns[0]


def test_round_robin_takes_turns_whatever_is_cached() -> None:
    c = Chooser("round-robin")
    assert [choose(c, {"a": [G, G], "b": []}) for _ in range(3)] == ["a", "b", "a"]


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        Chooser("random")
    with pytest.raises(ValueError, match="weight cpu"):
        Weights(cpu=-1)
    with pytest.raises(ValueError, match="no engine"):
        Chooser().choose([], 1, lambda e: [], lambda e: 0)
