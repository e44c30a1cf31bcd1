"""The serving benchmark's parts that need no server: arrivals, workloads, percentiles,
and reading kvtier's figures out of a /metrics scrape."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from kvtier.vllm.engines.chat_workloads import Workload, documents, multi_turn, unique
from kvtier.vllm.engines.load_client import arrivals, messages_of, percentile
from kvtier.vllm.engines.openai_server import kvtier_counters

WORDS = [f"w{i}" for i in range(100)]


def test_arrivals_are_a_seeded_poisson_process_at_the_rate() -> None:
    times = arrivals(4000, 8.0, seed=3)
    assert times == arrivals(4000, 8.0, seed=3) and times[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) > 0
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate=0"):
        arrivals(3, 0.0, seed=0)


def test_a_later_turn_carries_the_history_and_the_answers() -> None:
    chat = multi_turn(WORDS, conversations=3, turns=2, words_per_turn=5, max_tokens=4)
    assert chat.order == ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1))
    said = chat.sessions[1].users
    assert messages_of(chat, 1, ["w7 w8"]) == [
        {"role": "user", "content": said[0]},
        {"role": "assistant", "content": "w7 w8"},
        {"role": "user", "content": said[1]},
    ]
    docs = documents(WORDS, 2, 50, 3, 4, 4)
    assert docs.requests == 6 and len({s.system for s in docs.sessions}) == 2
    assert messages_of(docs, 0, [])[0]["role"] == "system"
    assert len({s.users for s in unique(WORDS, 5, 20, 4).sessions}) == 5


def test_a_turn_before_the_one_it_follows_is_refused() -> None:
    chat = multi_turn(WORDS, 1, 2, 5, 4)
    with pytest.raises(ValueError, match="session 0 turn 1 arrives out of turn order"):
        Workload("bad", chat.sessions, ((0, 1), (0, 0)), 4)


def test_percentiles_interpolate_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([], 90) == 0.0
    with pytest.raises(ValueError, match="q=101"):
        percentile(values, 101)


def test_kvtier_counters_by_tier() -> None:
    scrape = "\n".join(
        [
            "# TYPE vllm:kvtier_hit_blocks_total counter",
            'vllm:kvtier_hit_blocks_total{engine="0",model_name="m",tier="cpu"} 12.0',
            'vllm:kvtier_hit_blocks_created{engine="0",model_name="m",tier="cpu"} 1.7e9',
            'vllm:kvtier_lookup_blocks_total{engine="0",model_name="m",tier="cpu"} 20.0',
            'vllm:kvtier_used_blocks{engine="0",model_name="m",tier="disk"} 3.0',
            'vllm:kvtier_lookup_seconds_bucket{le="0.1",tier="redis"} 2.0',
            'vllm:num_requests_running{engine="0"} 1.0',
        ]
    )
    assert kvtier_counters(scrape) == {
        "cpu": {"hit_blocks": 12.0, "lookup_blocks": 20.0},
        "disk": {"used_blocks": 3.0},
    }
