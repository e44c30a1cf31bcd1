"""Injected slow disk I/O, for tests and benchmarks only: off unless one sets it.

Every figure kvtier had was measured on a local disk that answers at once; a disk shared
with other writers does not. This hook lets a test (or `bench_serving`'s slow-disk
profile) make the disk tier's I/O threads slow, or stall, without a slow disk:
`DiskStore.io_hook` is called by the I/O thread before each block file it reads or
writes, with "read" or "write" (a test in the same process may set any callable there:
one that waits on an event stalls the disk until the test sets it).

A store in a child process (a vLLM engine's worker) takes its hook from the environment,
`KVTIER_DISK_IO_DELAY="read=0.05,write=0.01"` (seconds per block file; either key may be
left out). Any other key, or a value that is not a finite number >= 0, is refused with
the key and what is allowed.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.validate import key_values

ENV = "KVTIER_DISK_IO_DELAY"
KINDS = ("read", "write")
IOHook = Callable[[str], None]


@dataclass(frozen=True)
class SlowIO:
    """Seconds each block file's read or write is held up (by a wait, not by a busy loop:
    a slow disk leaves the CPU free)."""

    read_s: float = 0.0
    write_s: float = 0.0

    def __post_init__(self) -> None:
        for kind in KINDS:
            value = getattr(self, f"{kind}_s")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{ENV}: {kind}={value!r}; a number of seconds >= 0")
            if not 0 <= value < math.inf:
                raise ValueError(f"{ENV}: {kind}={value!r}; a finite number of seconds >= 0")

    @classmethod
    def parse(cls, text: str) -> SlowIO:
        """`"read=0.05,write=0.01"` (the environment variable's form)."""
        seconds: dict[str, float] = {}
        given = key_values(text, dict.fromkeys(KINDS, "SECONDS"), f"{ENV}: ")
        for key, value in given.items():
            try:
                seconds[f"{key}_s"] = float(value)
            except ValueError:
                allowed = "a number of seconds >= 0"
                raise ValueError(f"{ENV}: {key}={value!r}; {allowed}") from None
        return cls(**seconds)

    def hook(self) -> IOHook | None:
        """The I/O threads' hook, or None when nothing is slowed."""
        if not (self.read_s or self.write_s):
            return None
        delays = {"read": self.read_s, "write": self.write_s}

        def slow(kind: str) -> None:
            if delays[kind]:
                time.sleep(delays[kind])

        return slow


def hook_from_env() -> IOHook | None:
    """The hook `KVTIER_DISK_IO_DELAY` asks for, or None (unset or empty: no hook)."""
    text = os.environ.get(ENV, "")
    return SlowIO.parse(text).hook() if text.strip() else None
