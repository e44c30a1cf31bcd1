"""What the command line checks before it does any work, and how it stops.

A replay can run for minutes; a flag that does not apply, an output path that cannot
be written or a size the machine cannot hold must be refused at once, naming the
flag, not found at the end (or as a MemoryError traceback half way).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtier.sim.replay_config import REPLAY_DISK_PREFIX

# argparse takes "-1,1,1" for an option (its negative-number pattern knows only plain
# numbers), so `--mix -1,1,1` failed with "expected one argument". Dashed comma lists
# of numbers are values here: no kvtier flag looks like one.
NUMBER_LIST = re.compile(r"^-\d*\.?\d+([eE][-+]?\d+)?(,[-+]?\d*\.?\d+([eE][-+]?\d+)?)*$")

# Bytes of bookkeeping per block, measured (`/usr/bin/time -f %M kvtier replay
# --limit 5 --gpu-blocks 3000000`: +346 MB, ~115 bytes per block), rounded up.
GPU_BLOCK_BYTES = 128
DISK_BLOCK_BYTES = 8  # the disk manager's slot table: one list entry per block
# The generated workload, per request (--requests 300000: +1.3 GB), rounded up.
GENERATED_REQUEST_BYTES = 4608


class Given(argparse.Action):
    """`store`, and remember that the user gave the flag (defaults are not "given")."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.option_strings[0]}


def mix(text: str) -> tuple[float, float, float]:
    """`--mix` as 3 finite shares >= 0 with a positive sum."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 3:
        raise argparse.ArgumentTypeError(
            f"expected 3 comma-separated shares (chats, agents, documents), got {text!r}"
        )
    for name, value in zip(("chats", "agents", "documents"), values, strict=True):
        if not 0 <= value < math.inf:
            raise argparse.ArgumentTypeError(
                f"the share of {name} must be a finite number >= 0, got {value:g} in {text!r}"
            )
    if sum(values) <= 0:
        raise argparse.ArgumentTypeError(f"at least one share must be > 0, got {text!r}")
    return values[0], values[1], values[2]


def worker_counts(text: str) -> tuple[int, ...]:
    """`--engine-sizes` as integers >= 1 (each engine's tensor-parallel workers)."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of worker counts >= 1 (one per engine), got {text!r}"
        )
    return values


def allow_negative_lists(parser: argparse.ArgumentParser) -> None:
    parser._negative_number_matcher = NUMBER_LIST  # see NUMBER_LIST


def inapplicable_flags(args: argparse.Namespace) -> str | None:
    """A flag given where it changes nothing, as an error message (None: all apply)."""
    given: set[str] = getattr(args, "given", set())
    if args.trace is not None:
        shaping = [f for f in ("--requests", "--mix", "--seed") if f in given]
        if shaping:
            return (
                f"{' and '.join(shaping)}: the generated workload's flags do not apply "
                f"with --trace {args.trace}"
            )
    elif "--format" in given:
        return "--format applies only with --trace FILE"
    if args.command != "replay":
        return None
    if "--store-on" in given and not args.gpu_blocks:
        return "--store-on applies only with an accelerator tier (--gpu-blocks N > 0)"
    if "--router" in given and args.engines == 1:
        return "--router applies only with several engines (--engines N > 1)"
    sizes = getattr(args, "engine_sizes", None)
    if sizes is not None and args.engines == 1:
        return "--engine-sizes applies only with several engines (--engines N > 1)"
    if sizes is not None and len(sizes) != args.engines:
        return (
            f"--engine-sizes gives {len(sizes)} engine(s) ({','.join(map(str, sizes))}) "
            f"but --engines is {args.engines}: give one worker count per engine"
        )
    vllm_config = getattr(args, "vllm_config", None) is not None
    if vllm_config and args.engines > 1:
        return "--engines N replays kvtier's own flags; --vllm-config replays one engine"
    for flag in ("--kv-bytes-per-block", "--model-config"):
        if getattr(args, flag[2:].replace("-", "_"), None) is not None and not vllm_config:
            return f"{flag} applies only with --vllm-config"
    if vllm_config:
        return None  # the config's tiers decide what applies (kvtier.cli.vllm_config)
    if "--redis-namespace" in given and args.redis is None:
        return "--redis-namespace applies only with a Redis tier (--redis URL)"
    if "--disk-writes" in given and not args.disk_blocks:
        return "--disk-writes applies only with a disk tier (--disk-blocks N > 0)"
    return None


def unwritable_output(args: argparse.Namespace) -> str | None:
    """An output flag (--png, --report) whose file cannot be written, checked before the run."""
    for flag, value in (("--png", getattr(args, "png", None)), ("--report", args.report)):
        if value is None:
            continue
        path = Path(value)
        parent = path.parent
        if path.is_dir():
            return f"{flag} {value}: is a directory, expected a file name"
        if not parent.is_dir():
            return f"{flag} {value}: directory {parent} does not exist"
        if not os.access(path if path.exists() else parent, os.W_OK):
            return f"{flag} {value}: not writable by this user"
    return None


def available_memory() -> int:
    """Bytes the kernel says a new allocation can get without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def memory_needed(args: argparse.Namespace, block_bytes: int) -> list[tuple[str, int, str]]:
    """(flag, bytes, why) for each size flag that allocates up front."""
    needs: list[tuple[str, int, str]] = []
    if args.trace is None:
        n = min(args.requests, args.limit or args.requests)
        needs.append(
            (f"--requests {args.requests}", n * GENERATED_REQUEST_BYTES, "generated requests")
        )
    if args.command != "replay":
        return needs
    gpu_per_block = GPU_BLOCK_BYTES + (block_bytes if args.data else 0)
    if args.gpu_blocks:
        why = "bookkeeping" + (" and KV bytes" if args.data else "")
        needs.append((f"--gpu-blocks {args.gpu_blocks}", args.gpu_blocks * gpu_per_block, why))
    if args.data and args.cpu_blocks:
        needs.append((f"--cpu-blocks {args.cpu_blocks}", args.cpu_blocks * block_bytes, "KV bytes"))
    if args.disk_blocks:
        needs.append(
            (f"--disk-blocks {args.disk_blocks}", args.disk_blocks * DISK_BLOCK_BYTES, "slot table")
        )
    return needs


def check_memory(
    args: argparse.Namespace, block_bytes: int, available: Callable[[], int] = available_memory
) -> None:
    """Refuse sizes that cannot fit in memory, with the figures, before allocating any."""
    needs = memory_needed(args, block_bytes)
    total = sum(n for _, n, _ in needs)
    if not needs or total < 1 << 28:  # under 256 MB: not worth a look
        return
    free = available()
    if total <= free:
        return
    parts = "; ".join(f"{flag}: {_gb(n)} of {why}" for flag, n, why in needs if n > total / 100)
    raise ValueError(
        f"these sizes need about {_gb(total)} of memory ({parts}), more than the "
        f"{_gb(free)} available; give smaller sizes"
    )


def block_bytes_of(args: argparse.Namespace) -> int:
    """Bytes of one block of the replay's `--data` layout for this trace format."""
    from kvtier.sim.bytes_plane import small_layout
    from kvtier.sim.generator import GeneratorConfig
    from kvtier.sim.workload import format_block_size

    size = GeneratorConfig.block_size if args.trace is None else format_block_size(args.format)
    return small_layout(size).bytes_per_block


def reclaim_replay_dirs(root: str | None = None) -> int:
    """Delete replay disk directories whose process is gone (killed by SIGKILL: nothing
    ran to remove them); one in use is locked by its `DiskStore` and kept."""
    from kvtier.store.diskdir import reclaim_abandoned

    return reclaim_abandoned(Path(root or tempfile.gettempdir()), REPLAY_DISK_PREFIX)


class ReportError(OSError):
    """A report file could not be written after the run; carries the run's document so
    that `--json` still prints it."""

    def __init__(self, message: str, document: dict[str, Any]) -> None:
        super().__init__(message)
        self.document = document


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every `finally` and context manager runs
    (the replay's temporary disk directory is removed on the way out)."""


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises `Terminated` (main thread only; restored after)."""
    if sys.platform == "win32" or not _main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
