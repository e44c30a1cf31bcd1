"""A short version of the serving benchmark's multi-turn workload against real servers.

Two servers started together (one start's time): vLLM's OpenAI server alone and the
same server with kvtier's CPU tier, the engine tests' tiny model with seeded weights (a
wrong KV block changes the greedy answer) and a pool of 24 blocks. Six conversations of
two turns, each turn the conversation so far plus a new message of 150 words: the first
turns together need more blocks than the pool holds, so a conversation's second turn
finds its first turn evicted from the pool and only kvtier still holds it. Served one
request at a time through the benchmark's client (streamed chat completions), so the
caches' states, and the figures, are the same on every run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvtier.vllm.engines import TINY
from kvtier.vllm.engines.chat_workloads import multi_turn
from kvtier.vllm.engines.load_client import Answer, run_one_by_one
from kvtier.vllm.engines.openai_server import ServerConfig, kvtier_counters, running_servers
from kvtier.vllm.engines.tokenizer import chat_model, words
from tests.vllm.conftest import EngineRuns

BLOCK = 32
CONVERSATIONS = 6


@dataclass(frozen=True)
class Played:
    answers: dict[str, list[Answer]]  # by side: "vllm", "kvtier"
    tiers: dict[str, dict[str, float]]  # kvtier's /metrics figures after the run


@pytest.fixture(scope="session")
def played(engine_runs: EngineRuns, tiny_model: Path) -> Played:
    return engine_runs.once("serving-load", lambda workdir: _play(tiny_model, workdir))


def _play(tiny_model: Path, workdir: Path) -> Played:
    from kvtier.vllm import transfer_config

    model = chat_model(tiny_model, workdir / "model", TINY.vocab)
    alone = ServerConfig(model, BLOCK, pool_blocks=24, max_model_len=512, max_num_seqs=4)
    kvtier = transfer_config(cpu_bytes_to_use=128 * TINY.kv_bytes(BLOCK))
    configs = {"vllm": alone, "kvtier": replace(alone, kv_transfer_config=kvtier)}
    workload = multi_turn(words(TINY.vocab), CONVERSATIONS, 2, 150, 8, seed=5)
    with running_servers(configs, workdir) as servers:
        answers = {side: run_one_by_one(s.url, "model", workload) for side, s in servers.items()}
        tiers = kvtier_counters(servers["kvtier"].get("/metrics"))
    return Played(answers, tiers)


def test_every_request_is_answered(played: Played) -> None:
    for side, answers in played.answers.items():
        assert [a.error for a in answers if not a.ok] == [], side
        assert all(a.output_tokens == 8 for a in answers), side


def test_later_turns_are_served_from_kvtier(played: Played) -> None:
    first = {a.session: a for a in played.answers["kvtier"] if a.turn == 0}
    later = [a for a in played.answers["kvtier"] if a.turn == 1]
    assert len(later) == CONVERSATIONS
    for answer in later:
        # the whole first turn's prompt, in full blocks (the pool no longer held it)
        assert answer.cached_tokens >= first[answer.session].prompt_tokens // BLOCK * BLOCK
    alone = sum(a.cached_tokens for a in played.answers["vllm"] if a.turn == 1)
    assert alone < sum(a.cached_tokens for a in later) // 2  # the pool alone lost most
    cpu = played.tiers["cpu"]
    assert cpu["hit_blocks"] > 0 and cpu["load_blocks"] > 0
    assert cpu.get("load_failures", 0) == 0


def test_answers_are_vllm_alones(played: Played) -> None:
    def texts(side: str) -> list[tuple[int, int, str]]:
        return [(a.session, a.turn, a.text) for a in played.answers[side]]

    assert texts("kvtier") == texts("vllm")
    assert len({a.text for a in played.answers["vllm"]}) > 1  # the model says different things
