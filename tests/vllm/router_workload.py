"""Multi-turn conversations through a router, one request at a time: each turn's
prompt is the conversation so far (the engine's earlier answers included) plus a new
user message, so every returning turn extends a prefix some engine computed."""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.vllm.engines.tokenizer import words

MAX_TOKENS = 8


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    status: int
    engine: str  # who answered, as the router says (X-Kvtier-Engine)
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # streaming: until the first content chunk


def user_messages(
    conversations: int, turns: int, words_per_turn: int, vocab: int, seed: int
) -> list[list[str]]:
    rng = random.Random(seed)
    vocabulary = words(vocab)
    return [
        [" ".join(rng.choices(vocabulary, k=words_per_turn)) for _ in range(turns)]
        for _ in range(conversations)
    ]


def play(
    base: str,
    messages: list[list[str]],
    *,
    stream: bool = False,
    before: Callable[[int], None] | None = None,
) -> list[Turn]:
    """Turn 0 of every conversation, then turn 1 of every one, and so on.

    `before(k)` runs before the k-th request (faults)."""
    history: list[list[dict[str, str]]] = [[] for _ in messages]
    out: list[Turn] = []
    turns = len(messages[0])
    for t in range(turns):
        for c, said in enumerate(messages):
            if before is not None:
                before(len(out))
            history[c].append({"role": "user", "content": said[t]})
            body: dict[str, Any] = {
                "model": "tiny",
                "messages": history[c],
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            turn, reply = (_streamed if stream else _whole)(base, body, c, t)
            out.append(turn)
            history[c].append({"role": "assistant", "content": reply})
    return out


def _whole(base: str, body: dict[str, Any], c: int, t: int) -> tuple[Turn, str]:
    started = time.perf_counter()
    status, answer, engine = post(base + "/v1/chat/completions", body)
    elapsed = time.perf_counter() - started
    if status != 200:
        return Turn(c, t, status, engine, 0, 0, elapsed), ""
    usage = answer["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reply = answer["choices"][0]["message"]["content"] or ""
    return Turn(c, t, status, engine, usage["prompt_tokens"], cached, elapsed), reply


def _streamed(base: str, body: dict[str, Any], c: int, t: int) -> tuple[Turn, str]:
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(
        base + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    first: float | None = None
    reply, usage = [], {}
    with urllib.request.urlopen(request, timeout=300) as r:
        engine = r.headers.get("X-Kvtier-Engine", "")
        status = r.status
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # vLLM reports a failed stream inside it, after a 200
                status = int(chunk["error"].get("code") or 500)
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    first = first or time.perf_counter()
                    reply.append(text)
            usage = chunk.get("usage") or usage
    ttft = (first or time.perf_counter()) - started
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    turn = Turn(c, t, status, engine, usage.get("prompt_tokens", 0), cached, ttft)
    return turn, "".join(reply)


def post(url: str, body: dict[str, Any], timeout_s: float = 300) -> tuple[int, dict[str, Any], str]:
    """POST JSON; (status, answer, the engine the router says answered)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return r.status, json.loads(r.read()), r.headers.get("X-Kvtier-Engine", "")
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}, ""
