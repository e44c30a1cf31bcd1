"""How engines are timed against each other (kvtier.vllm.engines.compare), without engines:
the order, the best of repeats, the cold-request check, and the CPU binding vLLM gives."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchmarks import bench_vllm, vllm_demo

from kvtier.vllm.engines import EngineJob, JobResult, RequestResult, Round
from kvtier.vllm.engines.compare import (
    RESERVED_CPUS_ENV,
    balanced_order,
    best_of,
    cached_tokens,
    cold_agreement,
    run_sides,
    same_cpus_env,
)
from tests.vllm.needs_vllm import quiet, require_vllm


def result(*rounds: tuple[tuple[float, int], ...]) -> JobResult:
    """A run: per round, per request (wall seconds, cached tokens)."""
    return JobResult(
        start_s=1.0,
        rounds=tuple(
            tuple(RequestResult((), (), cached, wall, wall) for wall, cached in rnd)
            for rnd in rounds
        ),
        log="",
    )


def test_balanced_order_gives_every_side_every_position() -> None:
    assert balanced_order(("A", "K"), 1) == (("A", 0), ("K", 0))
    order = balanced_order(("A", "K"), 4)
    assert [side for side, _ in order] == list("AKKAAKKA")
    assert [repeat for _, repeat in order] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s for s, _ in balanced_order(("A", "B", "C"), 2)] == list("ABCCBA")


@pytest.mark.parametrize(("sides", "repeats"), [(("A", "K"), 0), ((), 2), (("A", "A"), 2)])
def test_balanced_order_refuses(sides: tuple[str, ...], repeats: int) -> None:
    with pytest.raises(ValueError, match=r"repeats|sides"):
        balanced_order(sides, repeats)


def test_run_sides_runs_in_balanced_order_and_groups_by_side() -> None:
    jobs = {side: EngineJob(Path(side), (Round(((1, 2),)),)) for side in ("A", "K")}
    ran: list[tuple[str, int]] = []

    def run(side: str, repeat: int, job: EngineJob) -> JobResult:
        assert job is jobs[side]
        ran.append((side, repeat))
        return result(((float(len(ran)), 0),))

    runs = run_sides(jobs, 2, run)
    assert ran == [("A", 0), ("K", 0), ("K", 1), ("A", 1)]
    assert [r.rounds[0][0].wall_s for r in runs["A"]] == [1.0, 4.0]
    assert [r.rounds[0][0].wall_s for r in runs["K"]] == [2.0, 3.0]


def test_best_of_takes_each_request_from_its_fastest_run() -> None:
    first = result(((0.3, 0), (0.5, 64)), ((0.2, 0),))
    second = result(((0.4, 0), (0.1, 96)), ((0.1, 0),))
    best = best_of([first, second])
    assert [[r.wall_s for r in rnd] for rnd in best] == [[0.3, 0.1], [0.1]]
    assert best[0][1].num_cached_tokens == 96  # the fastest run's own result
    assert cached_tokens([first, second], 0, 1) == (64, 96)
    with pytest.raises(ValueError, match="different jobs"):
        best_of([first, result(((0.3, 0),))])
    with pytest.raises(ValueError, match="no runs"):
        best_of([])


def test_cold_agreement_compares_only_requests_cold_everywhere() -> None:
    # request 0 cold on both sides; request 1 cached on K (left out); request 2 cached
    # in one run of A only (left out too)
    a1 = result(((0.30, 0), (0.40, 0), (0.40, 0)))
    a2 = result(((0.33, 0), (0.40, 0), (0.20, 32)))
    k1 = result(((0.31, 0), (0.10, 512), (0.40, 0)))
    k2 = result(((0.36, 0), (0.10, 512), (0.40, 0)))
    cold = cold_agreement({"A": [a1, a2], "K": [k1, k2]})
    assert cold.requests == 1
    assert cold.seconds == {"A": 0.30, "K": 0.31}
    assert cold.ratio == pytest.approx(0.31 / 0.30)
    assert cold.noise == pytest.approx(0.36 / 0.31)  # K's own runs differ the most
    assert cold.within_noise is True


def test_cold_agreement_flags_a_gap_beyond_the_noise() -> None:
    # the demo: cold prompts 1.7x faster on one side, its runs within 10%
    alone = [result(((0.28, 0),)), result(((0.30, 0),))]
    kvtier = [result(((0.16, 0),)), result(((0.17, 0),))]
    cold = cold_agreement({"A": alone, "K": kvtier})
    assert cold.ratio == pytest.approx(0.28 / 0.16)
    assert cold.within_noise is False
    single = cold_agreement({"A": alone[:1], "K": kvtier[:1]})
    assert single.noise is None and single.within_noise is None


def test_cold_agreement_needs_a_cold_request() -> None:
    with pytest.raises(ValueError, match="no request was cold"):
        cold_agreement({"A": [result(((0.1, 32),))], "K": [result(((0.1, 0),))]})


def test_demo_sides_differ_only_in_the_connector(tmp_path: Path) -> None:
    workload = vllm_demo.multi_turn(chats=2, turns=2, first=64, step=32, others=1)
    alone = vllm_demo.engine_job(tmp_path, workload, None)
    kvtier = vllm_demo.engine_job(tmp_path, workload, {"kv_connector": "x"})
    assert alone.env == kvtier.env
    assert alone.env[RESERVED_CPUS_ENV] == same_cpus_env()[RESERVED_CPUS_ENV]
    assert alone.engine_kwargs() | {"kv_transfer_config": {"kv_connector": "x"}} == (
        kvtier.engine_kwargs()
    )


def _omp_cpus(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], connector: bool) -> object:
    """The cores vLLM's CPU build binds a one-worker engine's OpenMP threads to."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    monkeypatch.delenv(RESERVED_CPUS_ENV, raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            local_world_size=1, data_parallel_rank_local=None, _api_process_count=1
        ),
        kv_transfer_config=object() if connector else None,
    )
    return OMPProcessManager(config).cpu_lists


def test_same_cpus_env_gives_both_sides_the_same_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's 2x on cold prompts: vLLM reserves one more core for an engine with a
    connector, and where it cannot, binds it to every core (one core more than the
    engine without). With the reserve pinned both bind the same cores."""
    require_vllm()
    with quiet():
        from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        pytest.skip("vLLM's OpenMP binding is its CPU build's")
    pinned = same_cpus_env()
    with quiet():
        assert _omp_cpus(monkeypatch, pinned, True) == _omp_cpus(monkeypatch, pinned, False)
        if len(os.sched_getaffinity(0)) > 1:  # one core: nothing to reserve either way
            assert _omp_cpus(monkeypatch, {}, True) != _omp_cpus(monkeypatch, {}, False)
    with pytest.raises(ValueError, match="workers=0"):
        same_cpus_env(0)


def test_bench_vllm_engines_share_cpus_and_report_their_cold_prompts(tmp_path: Path) -> None:
    size = bench_vllm.Size(1024)
    assert (size.pool_blocks, size.kv_bytes) == (75, bench_vllm.QWEN2_05B.kv_bytes(1024))
    with pytest.raises(ValueError, match="multiple of 1024"):
        bench_vllm.Size(1000)
    rounds = (Round(((1, 2),)),)
    alone = bench_vllm._job(tmp_path, rounds, None, size)
    kvtier = bench_vllm._job(tmp_path, rounds, {"kv_connector": "x"}, size, tmp_path / "log")
    assert alone.env[RESERVED_CPUS_ENV] == kvtier.env[RESERVED_CPUS_ENV] == "1"

    def engine(cold_s: float) -> JobResult:
        run = result(((9.0, 0),), ((cold_s, 0),))
        return JobResult(run.start_s, run.rounds, "", ("return", bench_vllm.CALIBRATE))

    runs = {"baseline": engine(2.0), "kvtier": engine(2.2), "disk": engine(2.1)}
    comparable = bench_vllm.comparability(runs, size)
    assert comparable["cold_prompt_ttft_s"] == {"baseline": 2.0, "kvtier": 2.2, "disk": 2.1}
    assert comparable["cold_prompt_spread"] == pytest.approx(1.1)
    assert comparable["cold_prompt_tokens"] == 256
    assert RESERVED_CPUS_ENV in comparable["how"]
