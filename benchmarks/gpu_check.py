"""`make gpu-check`: the CUDA data plane's tests and copy benchmark, in one command.

Made for a lent GPU machine with torch but no vLLM and no network, where every
minute counts: it checks that kvtier and its dependencies import, runs `tests/gpu/`
(on CUDA tensors, and the CPU cases beside them), then `benchmarks/bench_copy.py`, and
writes `gpu_tests.xml`, `bench_copy.json`, `gpu_check.json` and `summary.txt` to
`--out`, printing the summary last (one screen). Exit status 0 only when every test
passed and the copy targets were met; each step has a time limit, so the whole stays
inside the 8 minutes a lease allows.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

DEPENDENCIES = (
    "numpy",
    "cbor2",
    "xxhash",
    "redis",
    "rich",
    "matplotlib",
    "torch",
    "pytest",
    "hypothesis",
)


def environment() -> dict[str, Any]:
    """The machine, and where each dependency was imported from (a missing one: None)."""
    found: dict[str, str | None] = {}
    for name in (*DEPENDENCIES, "kvtier"):
        try:
            module = importlib.import_module(name)
            found[name] = f"{getattr(module, '__version__', '?')} {getattr(module, '__file__', '')}"
        except ImportError:
            found[name] = None
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "imports": found,
    }
    if found["torch"] is not None:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return info


def _run(cmd: list[str], timeout: float) -> dict[str, Any]:
    """Run `cmd` within `timeout` seconds: its exit status (-1: timed out) and time."""
    start = time.monotonic()
    try:
        code = subprocess.run(cmd, timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        code = -1
    return {"exit": code, "seconds": round(time.monotonic() - start, 1)}


def run_tests(out: Path, timeout: float) -> dict[str, Any]:
    xml = out / "gpu_tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
    ]
    result = _run(cmd, timeout)
    if not xml.exists():
        return {
            **result,
            "passed": 0,
            "failed": ["(no report: pytest did not finish)"],
            "skipped": 0,
        }
    cases = ET.parse(xml).getroot().iter("testcase")
    failed, skipped, passed = [], 0, 0
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return {**result, "passed": passed, "failed": failed, "skipped": skipped}


def run_bench(out: Path, timeout: float, extra: list[str]) -> dict[str, Any]:
    path = out / "bench_copy.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_copy", "--out", str(path), *extra]
    result = _run(cmd, timeout)
    if result["exit"] != 0 or not path.exists():
        return result
    return {**result, **json.loads(path.read_text())}


def summary(env: dict[str, Any], tests: dict[str, Any], bench: dict[str, Any]) -> str:
    missing = [name for name, where in env["imports"].items() if where is None]
    lines = [
        f"gpu-check: {env.get('gpu')} torch {env.get('torch')} (CUDA {env.get('cuda')}), "
        f"Python {env['python']}",
        f"imports: {'all found' if not missing else 'MISSING ' + ', '.join(missing)}",
        f"tests/gpu: {tests['passed']} passed, {len(tests['failed'])} failed, "
        f"{tests['skipped']} skipped in {tests['seconds']} s",
        *[f"  FAILED {name}" for name in tests["failed"][:12]],
    ]
    rows = bench.get("rows")
    if not rows:
        lines.append(f"bench_copy: no result (exit {bench['exit']} after {bench['seconds']} s)")
        return "\n".join(lines)
    lines.append(
        f"bench_copy ({bench['seconds']} s): kvtier / raw pinned copy_, bytes per second "
        "(d2h | h2d) by run length"
    )
    lengths = sorted({r["blocks"] for r in rows})
    shown = [n for n in lengths if n in (1, 8, 32, 128, 512)] or lengths
    head = f"  {'model':5} {'layout':11} {'pattern':11} "
    lines.append(head + " ".join(f"{n:>11}" for n in shown) + "   raw GB/s @max")
    for key in dict.fromkeys((r["model"], r["layout"], r["pattern"]) for r in rows):
        mine = {r["blocks"]: r for r in rows if (r["model"], r["layout"], r["pattern"]) == key}
        cells = " ".join(
            f"{mine[n]['d2h']['ratio']:>5.2f}|{mine[n]['h2d']['ratio']:<5.2f}" for n in shown
        )
        top = mine[max(mine)]
        raw = f"{top['d2h']['raw_gbps']:.1f}|{top['h2d']['raw_gbps']:.1f}"
        lines.append(f"  {key[0]:5} {key[1]:11} {key[2]:11} {cells}   {raw}")
    s = bench["summary"]
    worst = s["worst_ratio_from_32_blocks"]
    lines.append(
        f"target (>= 0.90 of raw from 32 blocks, 0 wrong bytes): worst d2h {worst['d2h']:.3f}, "
        f"h2d {worst['h2d']:.3f}, wrong bytes {s['wrong_bytes']}: "
        f"{'MET' if s['target_met'] else 'MISSED'}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("out/gpu"), help="folder for the results")
    parser.add_argument("--tests-timeout", type=float, default=240.0, help="seconds for tests/gpu")
    parser.add_argument("--bench-timeout", type=float, default=180.0, help="seconds for bench_copy")
    parser.add_argument(
        "--bench-args", default="", help="extra bench_copy arguments, space-separated"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    print(json.dumps(env, indent=1), flush=True)
    tests = run_tests(args.out, args.tests_timeout)
    bench = run_bench(args.out, args.bench_timeout, args.bench_args.split())
    text = summary(env, tests, bench)
    report = {
        "environment": env,
        "tests": tests,
        "bench": {k: v for k, v in bench.items() if k != "rows"},
    }
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    (args.out / "summary.txt").write_text(text + "\n")
    print(text)
    ok = (
        not tests["failed"]
        and tests["exit"] == 0
        and bench.get("summary", {}).get("target_met", False)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
