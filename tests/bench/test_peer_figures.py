"""bench_peers' own logic, without vLLM, LMCache or a server: each side's counters read
out of its /metrics, the sides' turns, the spread between repeats, the fairness checks
and the issue's verdicts; and the memory row's reading of /proc (on a child process)."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from benchmarks.peer_figures import (
    LMCACHE_COUNTERS,
    VLLM_COUNTERS,
    ClientFigures,
    Comparison,
    counters,
    delta,
    fairness_problems,
    markdown_table,
    paired,
    restart_verdicts,
    saturation_ceilings,
    side_orders,
    spread,
    verdicts,
)
from benchmarks.peer_memory import MemoryPeaks, session_pids

VLLM_SCRAPE = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="model"} 3000.0
vllm:prefix_cache_queries_created{engine="0",model_name="model"} 1.7957814402949162e+09
vllm:prefix_cache_hits_total{engine="0",model_name="model"} 992.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="model"} 2008.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="model"} 896.0
vllm:prompt_tokens_total{engine="0",model_name="model"} 3000.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="model",source="local"} 5.0
vllm:kvtier_hit_blocks_total{engine="0",model_name="model",tier="cpu"} 28.0
"""
LMCACHE_SCRAPE = """\
lmcache_mp_l1_write_chunks_total{l1_tag="_default"} 62.0
lmcache_mp_l1_evicted_chunks_total{l1_tag="_default"} 31.0
lmcache_mp_l1_chunk_lifetime_seconds_bucket{l1_tag="_default",le="1.0"} 2.0
lmcache_mp_l1_read_chunks_total{l1_tag="_default"} 31.0
lmcache_mp_lookup_requested_tokens_total{cache_salt="",model_name="/m"} 2976.0
lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="/m"} 992.0
lmcache_mp_lookup_hit_tokens_total{cache_salt="tenant",model_name="/m"} 8.0
lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="",model_name="/m"} 992.0
lmcache_mp_lookup_hit_l2_tokens_total{cache_salt="",model_name="/m"} 0.0
"""


def figures(rps: float = 1.0, ttft: float = 1.0, **kw: int) -> ClientFigures:
    base = {"completed": 10, "failed": 0, "input_tokens": 1000, "output_tokens": 160}
    return ClientFigures(**(base | kw), requests_per_s=rps, ttft_mean_s=ttft, ttft_p50_s=ttft,
                         ttft_p90_s=ttft, ttft_p99_s=ttft)  # fmt: skip


def test_counters_read_each_sides_own_names_summed_over_labels() -> None:
    assert counters(VLLM_SCRAPE, VLLM_COUNTERS) == {
        "prompt_tokens": 3000.0,  # not the `_by_source` counter
        "pool_queries": 3000.0,  # not the `_created` stamp
        "pool_hits": 992.0,
        "external_queries": 2008.0,
        "external_hits": 896.0,
    }
    lmcache = counters(LMCACHE_SCRAPE, LMCACHE_COUNTERS)
    assert lmcache["hit_tokens"] == 1000.0 and lmcache["stored_chunks"] == 62.0
    assert lmcache["read_chunks"] == 31.0 and lmcache["hit_l2_tokens"] == 0.0
    # a side without LMCache's counters reads zeros, not a KeyError
    assert set(counters(VLLM_SCRAPE, LMCACHE_COUNTERS).values()) == {0.0}
    assert delta({"a": 1.0}, {"a": 4.0, "b": 2.0}) == {"a": 3.0, "b": 2.0}


def test_client_figures_from_the_serving_clients_result() -> None:
    result = {"completed": 36, "failed": 0, "total_input_tokens": 39168,
              "total_output_tokens": 576, "request_throughput": 1.5, "mean_ttft_ms": 800.0,
              "p50_ttft_ms": 700.0, "p90_ttft_ms": 1500.0, "p99_ttft_ms": 2000.0}  # fmt: skip
    f = ClientFigures.of(result)
    assert (f.completed, f.requests_per_s, f.ttft_mean_s, f.ttft_p90_s) == (36, 1.5, 0.8, 1.5)
    with pytest.raises(KeyError, match="--metric-percentiles 50,90,99"):
        ClientFigures.of({k: v for k, v in result.items() if k != "p99_ttft_ms"})


def test_every_side_goes_first_equally_often() -> None:
    orders = side_orders(["vllm", "kvtier", "lmcache"], 6)
    assert orders[0] == ("vllm", "kvtier", "lmcache")
    assert orders[1] == ("kvtier", "lmcache", "vllm")
    for position in range(3):
        assert Counter(o[position] for o in orders) == {"vllm": 2, "kvtier": 2, "lmcache": 2}
    assert all(sorted(o) == sorted(orders[0]) for o in orders)


def test_spread_and_when_a_gap_beats_it() -> None:
    assert spread([1.0]) is None
    assert spread([0.9, 1.1]) == pytest.approx(0.2)
    assert spread([0.0, 0.0]) == 0.0
    wide = Comparison.of([2.0, 2.2], [1.0, 1.3])  # ratio 2.1 / 1.15
    assert wide.ratio == pytest.approx(2.1 / 1.15)
    assert wide.spread == pytest.approx(0.3 / 1.15) and wide.decisive
    close = Comparison.of([1.0, 1.2], [1.0, 1.05])  # a 7% gap inside an 18% spread
    assert not close.decisive
    assert not Comparison.of([3.0], [1.0]).decisive  # one repeat: no spread, no claim
    with pytest.raises(ValueError, match="repeats on both sides"):
        Comparison.of([], [1.0])


def test_fairness_flags_what_makes_a_run_no_result() -> None:
    ref = figures()
    hit = {"external_hits": 896.0, "external_queries": 2000.0}
    assert fairness_problems("kvtier", True, ref, hit, {"hit_tokens": 896.0}, ref, 10) == []
    assert fairness_problems("vllm", True, ref, {}, {}, ref, 10) == []
    # a connector that served nothing on a reuse workload is a configuration mistake
    (miss,) = fairness_problems("lmcache", True, ref, {"external_hits": 0.0}, {}, ref, 10)
    assert "no tokens from its offload tier" in miss
    assert fairness_problems("lmcache", False, ref, {"external_hits": 0.0}, {}, ref, 10) == []
    # vLLM's count and LMCache's own must agree
    (disagree,) = fairness_problems("lmcache", True, ref, hit, {"hit_tokens": 100.0}, ref, 10)
    assert "LMCache 100" in disagree
    assert fairness_problems("vllm", True, ref, hit, {}, ref, 10)  # alone has no connector
    # other prompts, other answers, failed requests: not the same run
    other = figures(input_tokens=900, output_tokens=100, completed=9, failed=1)
    problems = fairness_problems("kvtier", False, other, {}, {}, ref, 10)
    assert len(problems) == 3 and "9/10 completed, 1 failed" in problems[0]


def _by_rate(**sides: list[ClientFigures]) -> dict[float, dict[str, list[ClientFigures]]]:
    return {math.inf: sides}


def test_reuse_verdicts_need_the_target_by_more_than_the_spread() -> None:
    lines = verdicts(
        {
            2.0: {
                "kvtier": [figures(ttft=0.5), figures(ttft=0.55)],
                "lmcache": [figures(ttft=1.0), figures(ttft=1.1)],
            },
            math.inf: {
                "kvtier": [figures(rps=3.0, ttft=2), figures(rps=3.3, ttft=2)],
                "lmcache": [figures(rps=1.0, ttft=4), figures(rps=1.6, ttft=4)],
            },
        },
        reuse=True,
    )
    assert [(v["rate"], v["target"].split()[0]) for v in lines] == [
        (2.0, "ttft_mean_s"), (2.0, "ttft_p90_s"),
        (None, "requests/s"), (None, "ttft_mean_s"), (None, "ttft_p90_s"),
    ]  # fmt: skip
    assert all(v["met"] for v in lines[:2])
    saturation = lines[2]
    # 3.15 / 1.3 = 2.4x, but LMCache's repeats spread by 46%: 2.4x is decisive, met
    assert saturation["ratio"] == pytest.approx(3.15 / 1.3) and saturation["met"]
    # 2.1x, but LMCache's repeats spread by 120%: a gap of 110% is no claim
    kvtier, lmcache = [figures(rps=2.1)] * 2, [figures(rps=0.4), figures(rps=1.6)]
    noisy = verdicts(_by_rate(kvtier=kvtier, lmcache=lmcache), reuse=True)
    assert noisy[0]["ratio"] == pytest.approx(2.1) and noisy[0]["spread"] == pytest.approx(1.2)
    assert not noisy[0]["decisive"] and not noisy[0]["met"]
    assert not verdicts(_by_rate(kvtier=[figures(rps=1.9)], lmcache=[figures()]), True)[0]["met"]


def test_paired_ratios_cancel_the_drift_between_repeats() -> None:
    # the machine slows by a fifth in the second repeat: both sides' medians spread by
    # 20%, each repeat's own ratio not at all
    got = paired([1.0, 0.8], [1.0, 0.8])
    assert got == {"per_repeat": [1.0, 1.0], "paired_ratio": 1.0, "paired_spread": 0.0}
    assert Comparison.of([1.0, 0.8], [1.0, 0.8]).spread == pytest.approx(0.2 / 0.9)
    assert paired([2.0], [0.0])["per_repeat"] != [2.0]  # no ratio to a zero: nan
    with pytest.raises(ValueError, match="as many on both sides"):
        paired([1.0], [1.0, 2.0])
    line = verdicts(
        _by_rate(vllm=[figures(), figures(rps=0.8)], kvtier=[figures(rps=0.98), figures(rps=0.8)]),
        reuse=False,
    )[0]
    assert line["per_repeat"] == pytest.approx([0.98, 1.0])
    assert line["paired_ratio"] == pytest.approx(0.99)
    assert line["paired_spread"] == pytest.approx(0.02 / 0.99)


def test_no_reuse_verdicts_need_repeats_that_resolve_the_bound() -> None:
    steady = verdicts(
        _by_rate(vllm=[figures(), figures(rps=1.01)], kvtier=[figures(rps=0.99), figures()],
                 lmcache=[figures(rps=0.9, ttft=1.8), figures(rps=0.9, ttft=1.8)]),
        reuse=False,
    )  # fmt: skip
    assert [v["target"].split()[0] for v in steady] == [
        "requests_per_s", "ttft_mean_s", "ttft_p90_s"
    ]  # fmt: skip
    assert all(v["met"] for v in steady) and steady[1]["lmcache_ratio"] == 1.8
    noisy = verdicts(
        _by_rate(vllm=[figures(), figures(rps=1.2)], kvtier=[figures(), figures(rps=1.2)]),
        reuse=False,
    )
    assert noisy[0]["ratio"] == 1.0 and not noisy[0]["met"]  # a 20% spread cannot show 3%
    farther = verdicts(
        _by_rate(vllm=[figures()] * 2, kvtier=[figures(ttft=1.04)] * 2,
                 lmcache=[figures(ttft=1.01)] * 2),
        reuse=False,
    )  # fmt: skip
    assert not farther[1]["met"]  # within 5%, but LMCache is closer to vLLM alone


def test_the_table_gives_medians_over_repeats_and_counts_problems() -> None:
    def side(rps: float, external: float, problems: list[str]) -> dict[str, object]:
        engine = {"pool_hits": 64.0, "external_hits": external, "prompt_tokens": 1000.0}
        client = figures(rps=rps).__dict__
        return {"client": client, "engine": engine, "problems": problems}

    runs = [
        {"row": "random", "rate": None, "order": ["lmcache", "vllm", "kvtier"],
         "vllm": side(1.0, 0, []), "kvtier": side(1.2, 0, []), "lmcache": side(0.8, 0, ["x"])},
        {"row": "random", "rate": None, "order": ["vllm", "kvtier", "lmcache"],
         "vllm": side(1.1, 0, []), "kvtier": side(1.0, 0, []), "lmcache": side(0.9, 0, [])},
    ]  # fmt: skip
    head, rule, vllm, kvtier, lmcache = markdown_table({"runs": runs}).splitlines()
    assert head.startswith("| row |") and rule == "|---|---|---|---|---|---|---|"
    assert vllm.startswith("| random | all at once | vllm | 1.05 (10%) | 1.00 / 1.00 /")
    assert kvtier.split(" | ")[3] == "1.10 (18%)"
    assert lmcache.endswith("| 64 / 0 / 1,000 | 1 |")


def test_memory_peaks_of_a_child_session() -> None:
    # a child in a session of its own that touches 64 MiB, says so, and waits for stdin
    code = "import sys; b = bytearray(64 << 20); b[::4096] = b'x' * (16 << 10); print(1, flush=True); sys.stdin.read()"  # noqa: E501
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == b"1\n"
        assert session_pids([child.pid]) == [child.pid]
        peaks = MemoryPeaks({"child": [child.pid], "none": []}, interval_s=60)
        peaks.sample()
        got = peaks.stop()
    finally:
        child.communicate(b"")
    assert got["child"]["processes"] == 1
    assert 64 <= got["child"]["peak_pss_mib"] <= got["child"]["sum_peak_rss_mib"] < 256
    name = Path(sys.executable).name[:15]  # the kernel keeps 15 bytes of a command name
    assert got["child"]["at_peak_mib"] == {f"{name}[{child.pid}]": got["child"]["peak_pss_mib"]}
    assert got["none"] == {
        "peak_pss_mib": 0.0,
        "at_peak_mib": {},
        "sum_peak_rss_mib": 0.0,
        "processes": 0,
    }
    with pytest.raises(ValueError, match="interval_s=0"):
        MemoryPeaks({}, interval_s=0)


def test_restart_verdicts_compare_the_medians_of_each_sides_returns() -> None:
    def returns(*seconds: float, tokens: float = 4096.0) -> list[dict[str, float]]:
        return [{"s": s, "pool_tokens": 0.0, "connector_tokens": tokens} for s in seconds]

    row = {
        "kvtier": {"cold": returns(20.0), "pool forgot": returns(0.10, 0.11, 0.10),
                   "restarted": returns(0.31, 0.16, 0.20)},
        "lmcache": {"cold": returns(20.5), "pool forgot": returns(0.14, 0.13, 0.14),
                    "restarted": returns(0.27, 0.26, 0.26, tokens=4095.0)},
    }  # fmt: skip
    cpu, disk = restart_verdicts(row)
    assert cpu["target"].startswith("from CPU memory")
    assert cpu["kvtier_s"] == 0.10 and cpu["lmcache_s"] == 0.14
    assert cpu["ratio"] == pytest.approx(0.10 / 0.14)
    assert cpu["spread"] == pytest.approx(0.01 / 0.10)  # kvtier's, the larger
    assert cpu["met"] and cpu["decisive"]
    # from disk: faster at the median (0.20 / 0.26), but kvtier's returns spread by 75%
    assert disk["ratio"] == pytest.approx(0.20 / 0.26)
    assert disk["kvtier_spread"] == pytest.approx(0.15 / 0.20)
    assert disk["lmcache_min_connector_tokens"] == 4095.0
    assert not disk["decisive"] and not disk["met"]
    # a side without returns of a step (an older result): no line for it
    del row["lmcache"]["restarted"]
    assert [v["target"] for v in restart_verdicts(row)] == [cpu["target"]]


def test_the_saturation_ceiling_from_the_tokens_each_side_computed() -> None:
    def side(rps: float, pool: float, external: float) -> dict[str, object]:
        engine = {"pool_hits": pool, "external_hits": external, "prompt_tokens": 25_000.0}
        client = {"completed": 24, "requests_per_s": rps}
        return {"client": client, "engine": engine}

    runs = [
        # vLLM alone computes 24,800 tokens in 10 s: 2,480 a second; kvtier and LMCache
        # found the same 12,400 tokens, so kvtier's best is 5 s against LMCache's 6 s
        {"row": "multi_turn", "rate": None, "vllm": side(2.4, 200, 0),
         "kvtier": side(4.0, 1_000, 11_400), "lmcache": side(4.0, 400, 12_000)},
        {"row": "multi_turn", "rate": 1.0, "vllm": side(1, 0, 0),
         "kvtier": side(1, 0, 0), "lmcache": side(1, 0, 0)},
        {"row": "random", "rate": None, "vllm": side(1, 0, 0)},  # no peers: no ceiling
    ]  # fmt: skip
    (line,) = saturation_ceilings(runs, ["multi_turn", "random", "documents"])
    assert line["row"] == "multi_turn"
    assert line["computed_tokens"] == {"vllm": 24_800, "kvtier": 12_600, "lmcache": 12_600}
    assert line["alone_tokens_per_s"] == pytest.approx(2_480)
    assert line["kvtier_best_s"] == pytest.approx(12_600 / 2_480)
    assert line["ceiling"] == pytest.approx(6.0 / (12_600 / 2_480))
    assert line["achieved"] == pytest.approx(1.0)
    # the line through vLLM alone (24,800 tokens, 10 s) and LMCache (12,600, 6 s): 4 s
    # for 12,200 tokens, so 2.07 s fixed; kvtier at LMCache's tokens sits on LMCache's 6 s
    fit = line["fit"]
    assert fit["per_token_ms"] == pytest.approx(4_000 / 12_200)
    assert fit["fixed_s"] == pytest.approx(10 - 24_800 * 4 / 12_200)
    assert fit["kvtier_floor_s"] == pytest.approx(6.0) and fit["ceiling"] == pytest.approx(1.0)
    # LMCache computing about what vLLM alone does: no line through two close points
    runs[0]["lmcache"] = side(4.0, 200, 900)
    assert saturation_ceilings(runs, ["multi_turn"])[0]["fit"] is None


def test_the_table_of_a_file_that_is_no_load_result_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.bench_peers import main

    not_runs = tmp_path / "restart.json"
    not_runs.write_text('{"verdicts": []}')
    for path, why in ((tmp_path / "none.json", "not a result"), (not_runs, "no runs")):
        with pytest.raises(SystemExit):
            main(["--table", str(path)])
        err = capsys.readouterr().err
        assert f"--table {path}: " in err and why in err, err
