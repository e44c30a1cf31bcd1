"""Prompts for engines that run without a tokenizer (`prompt_token_ids`)."""

from __future__ import annotations

import random


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    """Distinct prompts (their first tokens differ, so they share no block)."""
    rng = random.Random(seed)
    prompts: list[tuple[int, ...]] = []
    for index in range(count):
        body = [rng.randrange(3, vocab) for _ in range(length - 1)]
        prompts.append((3 + index % (vocab - 3), *body))
    return prompts
