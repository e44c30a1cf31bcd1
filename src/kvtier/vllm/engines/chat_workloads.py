"""Chat workloads for a server under load: who says what, and in which order it arrives.

A workload is sessions (conversations) of user turns. A turn's request is its session's
history so far (the server's earlier answers included) plus its user message, so a
returning turn extends a prefix the server computed; a session's next turn can only be
sent once its previous one is answered. Three shapes (issue 27):

- `multi_turn`: many conversations, turn 0 of each, then turn 1 of each, ...: between
  two turns of one conversation come all the others', so together they exceed the
  engine's pool and only an offload tier still holds a conversation when it returns;
- `documents`: questions over a few long documents (the document as the system
  message), in a seeded random order;
- `unique`: every prompt new, nothing to reuse (what kvtier costs when it cannot help).

Words are the caller's vocabulary (the model directory's word-level tokenizer makes
each word one token, so lengths in words are lengths in tokens).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Session:
    users: tuple[str, ...]  # the user messages, one per turn
    system: str | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    order: tuple[tuple[int, int], ...]  # (session, turn) in arrival order
    max_tokens: int  # each answer's length (ignore_eos)

    def __post_init__(self) -> None:
        seen: dict[int, int] = {}
        for session, turn in self.order:
            if turn != seen.get(session, 0):
                raise ValueError(
                    f"{self.name}: session {session} turn {turn} arrives out of turn order"
                )
            seen[session] = turn + 1

    @property
    def requests(self) -> int:
        return len(self.order)


def _text(rng: random.Random, words: Sequence[str], n: int) -> str:
    return " ".join(rng.choices(words, k=n))


def multi_turn(
    words: Sequence[str],
    conversations: int,
    turns: int,
    words_per_turn: int,
    max_tokens: int,
    seed: int = 0,
) -> Workload:
    rng = random.Random(seed)
    sessions = tuple(
        Session(tuple(_text(rng, words, words_per_turn) for _ in range(turns)))
        for _ in range(conversations)
    )
    order = tuple((c, t) for t in range(turns) for c in range(conversations))
    return Workload("multi_turn", sessions, order, max_tokens)


def documents(
    words: Sequence[str],
    documents: int,
    document_words: int,
    questions: int,
    question_words: int,
    max_tokens: int,
    seed: int = 0,
) -> Workload:
    """`questions` per document, each a session of one turn."""
    rng = random.Random(seed)
    docs = [_text(rng, words, document_words) for _ in range(documents)]
    sessions = tuple(
        Session((_text(rng, words, question_words),), system=docs[d])
        for d in range(documents)
        for _ in range(questions)
    )
    later = list(range(len(sessions)))
    rng.shuffle(later)
    return Workload("documents", sessions, tuple((s, 0) for s in later), max_tokens)


def unique(
    words: Sequence[str], requests: int, prompt_words: int, max_tokens: int, seed: int = 0
) -> Workload:
    rng = random.Random(seed)
    sessions = tuple(Session((_text(rng, words, prompt_words),)) for _ in range(requests))
    return Workload("unique", sessions, tuple((s, 0) for s in range(requests)), max_tokens)
