"""How engines are timed against each other (kvtier.vllm.engines.compare, .stepwise),
without engines: the interleaved order, the cold-request check, the CPU binding vLLM
gives, and the demo's and bench_vllm's use of them."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchmarks import bench_vllm, vllm_demo

from kvtier.vllm.engines import EngineJob, JobResult, RequestResult, Round
from kvtier.vllm.engines.compare import RESERVED_CPUS_ENV, cold_agreement, same_cpus_env, sign_test
from kvtier.vllm.engines.stepwise import interleaved_order, serve_interleaved
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


def test_interleaved_order_alternates_which_side_goes_first() -> None:
    order = list(interleaved_order(("A", "K"), 4))
    assert order == [(0, "A"), (0, "K"), (1, "K"), (1, "A"), (2, "A"), (2, "K"), (3, "K"), (3, "A")]
    assert [s for _, s in interleaved_order(("A", "B", "C"), 2)] == list("ABCCBA")
    for sides in ((), ("A", "A")):
        with pytest.raises(ValueError, match="each once"):
            list(interleaved_order(sides, 2))


class FakeEngine:
    """Answers request (r, i) with wall time r + i / 10 (+ 1 s on side K)."""

    def __init__(self, side: str, served: list[tuple[str, int, int]]) -> None:
        self.side, self.served = side, served

    def started(self) -> float:
        return 5.0

    def request(self, r: int, i: int) -> RequestResult:
        self.served.append((self.side, r, i))
        wall = r + i / 10 + (self.side == "K")
        return RequestResult((), (), 0, wall, wall)

    def log(self) -> str:
        return f"log {self.side}"


def test_serve_interleaved_alternates_request_by_request_and_rebuilds_rounds() -> None:
    rounds = (Round(((1,), (2,)), name="one"), Round(((3,),), name="two"))
    jobs = {side: EngineJob(Path(side), rounds) for side in ("A", "K")}
    served: list[tuple[str, int, int]] = []
    results = serve_interleaved(jobs, {side: FakeEngine(side, served) for side in jobs})
    assert served == [("A", 0, 0), ("K", 0, 0), ("K", 0, 1), ("A", 0, 1), ("A", 1, 0), ("K", 1, 0)]
    a, k = results["A"], results["K"]
    assert [[r.wall_s for r in rnd] for rnd in a.rounds] == [[0.0, 0.1], [1.0]]
    assert [[r.wall_s for r in rnd] for rnd in k.rounds] == [[1.0, 1.1], [2.0]]
    assert (a.start_s, a.log, a.round_names) == (5.0, "log A", ("one", "two"))
    other = {"A": jobs["A"], "K": EngineJob(Path("K"), rounds[:1])}
    with pytest.raises(ValueError, match="different shapes"):
        serve_interleaved(other, {})


def test_cold_agreement_pairs_only_requests_cold_on_both_sides() -> None:
    # request 1 is cached on K: left out of the pairs
    alone = result(((0.30, 0), (0.40, 0), (0.41, 0)), ((0.50, 0),))
    kvtier = result(((0.31, 0), (0.10, 512), (0.40, 0)), ((0.52, 0),))
    cold = cold_agreement({"A": alone, "K": kvtier})
    assert cold.pairs == 3
    assert cold.seconds == pytest.approx({"A": 1.21, "K": 1.23})
    assert cold.slower == {"A": 1, "K": 2}
    assert cold.median_ratio == pytest.approx(0.30 / 0.31)  # of that, 0.41/0.40 and 0.50/0.52
    assert cold.p_value == 1.0 and cold.within_noise


def test_cold_agreement_flags_one_side_always_faster() -> None:
    # the demo: every cold prompt ~1.7x faster on one side
    alone = result(tuple((0.28 + j / 100, 0) for j in range(9)))
    kvtier = result(tuple((0.16 + j / 100, 0) for j in range(9)))
    cold = cold_agreement({"A": alone, "K": kvtier})
    assert cold.slower == {"A": 9, "K": 0}
    assert cold.median_ratio == pytest.approx(0.32 / 0.20)
    assert cold.p_value == pytest.approx(2 / 2**9)
    assert not cold.within_noise


def test_sign_test() -> None:
    assert sign_test(0, 0) == 1.0
    assert sign_test(4, 5) == 1.0
    assert sign_test(8, 1) == pytest.approx(2 * 10 / 512)  # 0.039: an uneven split
    assert sign_test(7, 2) == pytest.approx(2 * 46 / 512)  # 0.18: noise can do that


def test_cold_agreement_refuses_what_it_cannot_compare() -> None:
    cold, cached = result(((0.1, 0),)), result(((0.1, 32),))
    with pytest.raises(ValueError, match="no request was cold"):
        cold_agreement({"A": cold, "K": cached})
    with pytest.raises(ValueError, match="two sides"):
        cold_agreement({"A": cold})
    with pytest.raises(ValueError, match="different requests"):
        cold_agreement({"A": cold, "K": result(((0.1, 0), (0.1, 0)))})


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


def test_bench_vllm_sizes_the_pool_of_a_hybrid_engine_for_every_kv_cache_group() -> None:
    """A hybrid engine's pool is shared by its six KV-cache groups (4 full-attention
    layers, 20 sliding-window layers of 512 tokens: five groups of four), and vLLM
    refuses to start one smaller than a whole prompt in every group (the base model's
    75 blocks at 1,024 tokens stopped it). At 1,024 tokens (max_model_len 1,056): 33
    blocks for the full group and 34 for each sliding one, 203 at the peak; a finished
    prompt leaves 32 + 5 x 16 = 112 cached, and the base model's 171/128 of that on top."""
    hybrid = bench_vllm.SHAPES["hybrid"]
    assert hybrid[0].kv_cache_groups == (1, 5)
    assert bench_vllm.QWEN2_05B.kv_cache_groups == (1, 0)
    assert bench_vllm.Size(1024, *hybrid, shape="hybrid").pool_blocks == 203 + 112 * 171 // 128
    assert bench_vllm.Size(4096, *hybrid, shape="hybrid").pool_blocks == 779 + 208 * 171 // 128
    assert [bench_vllm.Size(t).pool_blocks for t in (1024, 4096)] == [75, 300]
    tp = bench_vllm.SHAPES["tp"]
    assert bench_vllm.Size(4096, *tp, shape="tp").pool_blocks == 300


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
