"""KeyLookups (the tiering layer's per-key Redis lookups): a round trip with no answer is
asked again, and is a miss only once the tier is down."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.vllm.tiering.tier_lookup import KeyLookups

KEYS = [bytes([i]) * 32 for i in range(4)]


class _Tier:
    """Answers from a script: each call takes the next answer (None: no answer)."""

    def __init__(self, answers: list[int | None]) -> None:
        self.answers = answers
        self.asked: list[int] = []
        self.down = False

    def count(self, keys: Sequence[bytes]) -> int | None:
        self.asked.append(len(keys))
        return self.answers.pop(0)


def _ask_all(lookups: KeyLookups, req_id: str = "r") -> list[bool | None]:
    verdicts = [lookups.lookup(key, req_id) for key in KEYS]
    lookups.flush()
    assert lookups.wait(timeout=30)
    return verdicts


def test_a_round_trip_without_an_answer_is_asked_again() -> None:
    tier = _Tier([None, 3])
    lookups = KeyLookups(tier.count, "test", lambda: tier.down)
    try:
        assert _ask_all(lookups) == [None] * 4
        assert _ask_all(lookups) == [None] * 4  # no answer: not a miss, asked again
        assert [lookups.lookup(key, "r") for key in KEYS] == [True, True, True, False]
        assert tier.asked == [4, 4]
    finally:
        lookups.close()


def test_no_answer_while_the_tier_is_down_is_a_miss() -> None:
    tier = _Tier([None])
    lookups = KeyLookups(tier.count, "test", lambda: tier.down)
    try:
        assert _ask_all(lookups) == [None] * 4
        tier.down = True
        assert [lookups.lookup(key, "r") for key in KEYS] == [False] * 4
        lookups.flush()
        assert tier.asked == [4]  # nothing asked again
    finally:
        lookups.close()
