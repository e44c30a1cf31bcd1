"""bench_serving's tier profiles and bench_vllm's crossover table, without an engine:
how a profile is read (and a bad one refused, naming what is allowed), what a stall
profile does to the link, and how the crossover's cells are judged."""

from __future__ import annotations

import math

import pytest
from benchmarks.bench_serving import (
    by_turn,
    comparison_lines,
    comparisons,
    median_runs,
    parse_rates,
    parse_repeats,
    parse_rig_nice,
)
from benchmarks.serving_profiles import TierProfile, parse_profile, parse_profiles
from benchmarks.vllm_crossover import SIDES, TOKENS, Request, plan, summarize

from kvtier.store.slow_io import ENV, SlowIO
from kvtier.vllm.engines import RequestResult
from kvtier.vllm.engines.load_client import Answer


def test_profiles_are_read_field_by_field() -> None:
    assert parse_profile("cpu") == TierProfile("cpu")
    slow = parse_profile("redis:delay_ms=50:rate_mb_s=20")
    assert (slow.redis, slow.delay_s, slow.rate_bytes_per_s) == (True, 0.05, 20e6)
    assert slow.link.up_delay_s == slow.link.down_delay_s == 0.025
    assert parse_profile("redis:stall_after=8").stall_after == 8
    assert parse_profile("redis").server == "kvtier_redis"
    assert parse_profile("alone") == TierProfile("alone", control=True)
    assert parse_profile("alone").server == "vllm_control"
    assert [p.name for p in parse_profiles("cpu,redis:delay_ms=5")] == ["cpu", "redis:delay_ms=5"]
    slow_disk = parse_profile("disk:read_ms=50:write_ms=20")
    assert (slow_disk.disk, slow_disk.read_s, slow_disk.write_s) == (True, 0.05, 0.02)
    assert slow_disk.server == "kvtier_disk_read_ms_50_write_ms_20"
    # the worker reads the delays from its environment, as kvtier.store.slow_io parses them
    assert SlowIO.parse(slow_disk.env[ENV]) == SlowIO(read_s=0.05, write_s=0.02)
    assert (parse_profile("disk").server, parse_profile("disk").env) == ("kvtier_disk", {})
    assert not parse_profile("disk").redis and parse_profile("disk").stall_hook(None) is None
    demote = parse_profile("disk:demote=1")
    assert demote.demote and not parse_profile("disk:demote=0").demote
    assert demote.server == "kvtier_disk_demote_1" and not parse_profile("disk").demote


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ssd", "unknown kind 'ssd'; allowed: cpu, alone, redis[:FIELD=VALUE...]"),
        ("cpu:delay_ms=5", "unknown kind 'cpu'"),
        (
            "disk:delay_ms=5",
            "'delay_ms=5' is not FIELD=VALUE with FIELD one of read_ms, write_ms, demote",
        ),
        ("disk:demote=2", "demote='2'; 1: written on CPU eviction"),
        ("disk:read_ms=-1", "read_ms='-1'; milliseconds each block file's read is held up"),
        ("redis:delay=5", "'delay=5' is not FIELD=VALUE with FIELD one of delay_ms"),
        ("redis:delay_ms", "'delay_ms' is not FIELD=VALUE"),
        ("redis:delay_ms=-5", "delay_ms='-5'; milliseconds added to each round trip"),
        ("redis:delay_ms=fast", "delay_ms='fast'; milliseconds"),
        ("redis:delay_ms=inf", "delay_ms='inf'"),
        ("redis:rate_mb_s=0", "rate_mb_s='0'; the link's cap each way in MB/s, a number > 0"),
        ("redis:stall_after=1.5", "stall_after='1.5'; requests answered before Redis stalls"),
        ("redis:stall_after=-1", "stall_after='-1'"),
    ],
)
def test_a_bad_profile_names_the_part_and_what_is_allowed(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"tier profile '{text}'.*") as err:
        parse_profile(text)
    assert message in str(err.value)


def test_profiles_are_given_once_each() -> None:
    with pytest.raises(ValueError, match="each once"):
        parse_profiles("redis,redis")
    with pytest.raises(ValueError, match="at least one"):
        parse_profiles(",")


def test_rates_are_positive_and_increasing() -> None:
    assert parse_rates("0.5,1,inf") == (0.5, 1.0, math.inf)
    for bad in ("0", "-1", "fast", "nan", "2,1", "1,1"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)


class _Proxy:
    def __init__(self) -> None:
        self.stalled = False

    def stall(self) -> None:
        self.stalled = True


def test_a_stall_profile_stalls_the_link_before_its_request() -> None:
    proxy = _Proxy()
    hook = parse_profile("redis:stall_after=2").stall_hook(proxy)  # type: ignore[arg-type]
    assert hook is not None
    hook(0), hook(1)
    assert not proxy.stalled
    hook(2)
    assert proxy.stalled
    assert parse_profile("redis:delay_ms=5").stall_hook(proxy) is None  # type: ignore[arg-type]


def _result(seconds: float, cached: int = 0) -> RequestResult:
    return RequestResult((1,), ({1: 0.0},), cached, seconds, None)


def test_the_crossover_plan_warms_up_every_delay_then_walks_the_lengths() -> None:
    requests = plan(repeats=2)
    by_delay = [r for r in requests if r.delay_s == requests[0].delay_s]
    assert [r.kind for r in by_delay[:3]] == ["cold", "warm", "warm"]
    assert [r.tokens for r in by_delay[3:]] == [*TOKENS, *TOKENS]
    prompts = [p for r in requests for p in r.prompts]
    assert len(set(prompts)) == len(prompts)  # every prompt new
    cold = requests[0]
    assert not cold.in_redis and requests[1].in_redis
    # each side computes a cold prompt of its own (none finds another's in Redis)
    assert len({cold.prompt(side) for side in SIDES}) == len(SIDES)
    assert len({requests[1].prompt(side) for side in SIDES}) == 1


def test_a_crossover_cell_is_judged_against_the_better_side() -> None:
    requests = [
        Request(0.2, "cell", 256, ((1,),)),
        Request(0.2, "cell", 256, ((2,),)),
        Request(0.2, "cell", 4096, ((3,),)),
        Request(0.2, "cell", 4096, ((4,),)),
    ]
    seconds = {  # 256 tokens: recompute wins; 4,096: loading wins
        "recompute": [0.30, 0.34, 8.0, 8.2],
        "always": [0.60, 0.62, 0.5, 0.7],
        "measured": [0.33, 0.35, 0.9, 0.9],
    }
    served = {side: [_result(s) for s in seconds[side]] for side in SIDES}
    rows = summarize(requests, served)["rows"]
    short, long = rows
    assert short["measured_vs_best"] == pytest.approx(0.34 / 0.32)
    assert short["meets_target"]
    assert long["measured_vs_best"] == pytest.approx(0.9 / 0.6)
    assert not long["meets_target"]
    assert long["spread"]["always"] == pytest.approx(0.7 / 0.5)


def test_serving_runs_give_first_turns_and_later_ones_apart() -> None:
    def answer(turn: int, ttft: float, cached: int, ok: bool = True) -> Answer:
        return Answer(0, turn, ok, 0.0, ttft, 1.0, (), 100, cached, 4, "", "" if ok else "x")

    turns = by_turn(
        [answer(0, 0.1, 0), answer(0, 0.3, 0), answer(1, 0.2, 64), answer(2, 9.0, 0, ok=False)]
    )
    assert turns["first"]["requests"] == 2 and turns["first"]["ttft_mean_s"] == pytest.approx(0.2)
    assert turns["later"] == {
        "requests": 1, "ttft_p50_s": 0.2, "ttft_mean_s": 0.2, "cached_tokens": 64
    }  # fmt: skip
    assert turns.keys() == {"first", "later"}  # one later turn answered: nothing to split
    assert by_turn([answer(1, 0.2, 0)]).keys() == {"later"}
    three = by_turn([answer(0, 0.1, 0), answer(1, 0.2, 64), answer(1, 0.4, 64), answer(2, 0.3, 96)])
    assert three.keys() == {"first", "later", "turn_2", "turn_3"}
    assert three["turn_2"]["ttft_mean_s"] == pytest.approx(0.3)
    assert three["turn_3"]["cached_tokens"] == 96 and three["later"]["requests"] == 3


def _played(kvtier_rps: list[float], vllm_rps: list[float]) -> list[dict[str, object]]:
    """Repeats of one workload: one at a time and one rate (all at once), both sides
    with the given requests/s in each repeat and the TTFTs 0.5 s (kvtier) and 1 s."""

    def side(rps: float, ttft: float) -> dict[str, float]:
        return {"requests_per_s": rps, "ttft_mean_s": ttft, "ttft_p50_s": ttft,
                "ttft_p90_s": ttft}  # fmt: skip

    return [
        {
            "idle": {"kvtier": side(k, 0.5), "vllm": side(v, 1.0)},
            "runs": [{"rate": None, "kvtier": side(k, 0.5), "vllm": side(v, 1.0)}],
        }
        for k, v in zip(kvtier_rps, vllm_rps, strict=True)
    ]


def test_serving_repeats_are_compared_by_medians_and_judged_against_their_spread() -> None:
    played = _played([2.0, 2.2, 1.8], [1.0, 1.1, 0.9])
    got = comparisons(played)
    assert got.keys() == {"idle", "inf"}
    rps = got["inf"]["requests_per_s"]
    assert rps["ratio"] == pytest.approx(2.0)
    assert rps["spread"] == pytest.approx(0.2)  # (2.2 - 1.8) / 2.0, and the same for vLLM
    assert rps["decisive"]
    assert got["idle"]["ttft_p90_s"] == {
        "ratio": 0.5, "spread": 0.0, "decisive": True, "per_repeat": [0.5, 0.5, 0.5],
        "paired_ratio": 0.5, "paired_spread": 0.0,
    }  # fmt: skip
    assert rps["per_repeat"] == pytest.approx([2.0, 2.0, 2.0])
    close = comparisons(_played([1.0, 1.3], [1.1, 1.0]))["inf"]["requests_per_s"]
    assert close["ratio"] == pytest.approx(1.15 / 1.05)
    assert not close["decisive"]  # 9.5% apart, repeats 26% apart
    lines = comparison_lines({"comparisons": comparisons(_played([1.0, 1.3], [1.1, 1.0]))})
    assert lines[1].startswith("inf: requests_per ~x1.10 (26%; 0.91/1.30), ttft_mean x0.50 (0%;")
    single = comparisons(_played([2.0], [1.0]))["inf"]["requests_per_s"]
    assert single["spread"] is None and not single["decisive"]  # one repeat: no spread
    assert median_runs(played) == [
        {"rate": None, "kvtier": {"requests_per_s": 2.0, "ttft_mean_s": 0.5, "ttft_p50_s": 0.5,
                                  "ttft_p90_s": 0.5},
         "vllm": {"requests_per_s": 1.0, "ttft_mean_s": 1.0, "ttft_p50_s": 1.0,
                  "ttft_p90_s": 1.0}}
    ]  # fmt: skip


@pytest.mark.parametrize("text", ["0", "-1", "two", "1.5", ""])
def test_a_repeat_count_that_is_not_a_whole_number_of_at_least_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=f"--repeats {text!r}; a whole number >= 1"):
        parse_repeats(text)
    assert parse_repeats("3") == 3


@pytest.mark.parametrize("text", ["-1", "20", "low", "1.5", ""])
def test_a_rig_niceness_outside_0_to_19_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=f"--rig-nice {text!r}; a whole number from 0 to 19"):
        parse_rig_nice(text)
    assert (parse_rig_nice("0"), parse_rig_nice("19")) == (0, 19)
