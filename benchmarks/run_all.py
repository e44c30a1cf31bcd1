"""Run every benchmark in turn (`make bench`); each writes its own JSON to benchmarks/results/.

Each benchmark runs in its own process so that one's allocations and threads cannot
skew the next one's timings; `--quick` is passed through.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

BENCHMARKS = (
    "bench_hashing",
    "bench_gpu",
    "bench_offload",
    "bench_replay",
    "bench_store",
    "bench_redis",
    "bench_disk_writes",
    "bench_shared_disk",
    "bench_prefix_gap",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="each benchmark's short run")
    parser.add_argument("--only", default="", help="comma list of benchmark names to run")
    args = parser.parse_args(argv)
    selected = [b for b in BENCHMARKS if not args.only or b in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(BENCHMARKS) if args.only else set()
    if unknown:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; known: {', '.join(BENCHMARKS)}")
    failed = []
    for name in selected:
        print(f"== {name}", flush=True)
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *(["--quick"] if args.quick else [])]
        if subprocess.run(cmd, check=False).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
