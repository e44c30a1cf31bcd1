"""`make gpu-check`'s own logic, without a GPU: the copy target's verdict and the summary."""

from __future__ import annotations

from typing import Any

from benchmarks.bench_copy import summarise
from benchmarks.gpu_check import summary


def _row(blocks: int, d2h: float, h2d: float, wrong: int = 0) -> dict[str, Any]:
    side = {"kvtier_gbps": 50.0, "raw_gbps": 55.0}
    return {
        "model": "8b",
        "layout": "per_layer",
        "pattern": "consecutive",
        "blocks": blocks,
        "bytes": blocks << 21,
        "path": "kernel",
        "d2h": {**side, "ratio": d2h},
        "h2d": {**side, "ratio": h2d},
        "wrong_bytes": {"store": wrong, "load": 0},
    }


def test_the_target_is_judged_from_32_blocks_both_ways_and_on_every_byte() -> None:
    slow_short_run = [_row(8, 0.5, 0.5), _row(32, 0.91, 0.90), _row(512, 0.98, 0.97)]
    assert summarise(slow_short_run)["target_met"]
    assert not summarise([_row(32, 0.95, 0.89)])["target_met"]  # one direction short
    assert not summarise([_row(32, 0.95, 0.95, wrong=1)])["target_met"]
    assert not summarise([_row(8, 0.95, 0.95)])["target_met"]  # nothing judged
    assert summarise([_row(64, 0.93, 0.91)])["worst_ratio_from_32_blocks"] == {
        "d2h": 0.93,
        "h2d": 0.91,
    }


def test_the_summary_names_failures_missing_imports_and_the_verdict() -> None:
    env = {"gpu": "GPU", "torch": "2", "cuda": "13", "python": "3.12", "imports": {"redis": None}}
    tests = {"passed": 3, "failed": ["tests.gpu.t::a"], "skipped": 1, "seconds": 2.0}
    rows = [_row(32, 0.95, 0.85), _row(512, 0.99, 0.98)]
    bench = {"exit": 0, "seconds": 9.0, "rows": rows, "summary": summarise(rows)}
    text = summary(env, tests, bench)
    assert "MISSING redis" in text and "FAILED tests.gpu.t::a" in text
    assert "3 passed, 1 failed, 1 skipped" in text and text.endswith("MISSED")
    assert "no result (exit 2" in summary(env, tests, {"exit": 2, "seconds": 1.0})
