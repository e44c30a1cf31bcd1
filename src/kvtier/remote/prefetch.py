"""Values a Redis lookup read whole, kept for the load that follows on this engine.

A hit in a slow Redis costs two round trips: the lookup that finds it, then the load
that reads it. Through a link adding 0.2 s, a returning conversation's 16-block history
took 0.4 s to load where recomputing it took 0.3 s, so kvtier either waited and lost or
recomputed and gained nothing. Where a round trip costs more than carrying a block, the
lookup reads the first blocks it asks about whole (a GET where it would read a header),
and the load finds them here: one round trip for lookup and load together.

The lookup runs in the scheduler's process, the load in a worker's: the same process
in vLLM's engine of one GPU worker, a child of it where the engine runs its workers as
processes (every tensor-parallel engine, and every engine of vLLM's CPU build). So the
values are files in a directory of the scheduler's (in shared memory where there is
one), named by a hash of their key: the scheduler writes each one whole under a
temporary name and renames it (a reader never sees part of one), a worker reads it and
removes it (a value serves one load). A worker looks in its own process's directory and
its parent's, and says which values it loads (`serve`: a marker naming the key base), so
a lookup reads values whole only for a key base some worker of this engine loads: the
replay tool and engines whose workers could not take them read headers as before.

Bounded: at most `max_bytes` written and not yet taken or dropped (the oldest dropped
first), and a value not taken within `max_age_s` is dropped. Nothing here is trusted: a
load decodes and checks a value taken from here exactly as one read from Redis (its
header names its block, so a value under the wrong name is refused too). The directory
goes with the scheduler's process (at exit; a process killed outright leaves it, and the
next scheduler on the machine removes it).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash

from kvtier.validate import positive_int, seconds

MAX_BYTES = 256 * 1024 * 1024
MAX_AGE_S = 5.0
_PREFIX = "kvtier-prefetch-"


def default_root() -> Path:
    """Shared memory where the machine has it (a file there is memory), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


class PrefetchedValues:
    """Whole values by Redis key, for the next load of them on this engine (see the module
    docstring). Thread-safe: a lookup thread puts, the workers' threads take."""

    def __init__(
        self,
        root: Path | None = None,
        max_bytes: int = MAX_BYTES,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        positive_int("prefetch max_bytes", max_bytes)
        if seconds("prefetch max_age_s", max_age_s) <= 0:
            raise ValueError(f"prefetch max_age_s={max_age_s!r}; a number of seconds > 0")
        self.root = default_root() if root is None else root
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        # what this process wrote and may not have been taken: file name -> (size, when)
        self._written: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._bytes = 0
        self._pid: int | None = None  # the process the directory was made for
        self._markers: dict[bytes, list[Path]] = {}  # key base -> markers this process made

    # -- where ------------------------------------------------------------------------

    def directory(self, pid: int | None = None) -> Path:
        """The directory of the scheduler in process `pid` (default this one)."""
        return self.root / f"{_PREFIX}{os.getuid()}-{os.getpid() if pid is None else pid}"

    def _own(self) -> Path:
        """This process's directory, made (and the ones dead processes left removed) on
        first use in the process."""
        pid = os.getpid()
        directory = self.directory(pid)
        if self._pid != pid:
            self._pid = pid
            self._written.clear()
            self._bytes = 0
            _remove_orphans(self.root)
            directory.mkdir(parents=True, exist_ok=True)
            atexit.register(shutil.rmtree, directory, True)
        return directory

    def _candidates(self) -> list[Path]:
        """Where a worker looks: its own process's directory and its parent's."""
        return [self.directory(os.getpid()), self.directory(os.getppid())]

    # -- who loads --------------------------------------------------------------------

    def serve(self, key_base: bytes) -> None:
        """A worker here loads values whose keys start with `key_base`: say so to the
        scheduler of this process or of its parent (whichever this worker's is)."""
        made = self._markers.setdefault(key_base, [])
        for directory in self._candidates():
            with contextlib.suppress(OSError):
                directory.mkdir(parents=True, exist_ok=True)
                marker = directory / _marker(key_base, os.getpid())
                marker.touch()
                made.append(marker)

    def unserve(self, key_base: bytes) -> None:
        for marker in self._markers.pop(key_base, []):
            with contextlib.suppress(OSError):
                marker.unlink()

    def serves(self, key_base: bytes) -> bool:
        """Whether a worker of this scheduler loads values under `key_base`."""
        directory = self.directory()
        pattern = _marker(key_base, 0).rsplit(".", 1)[0] + ".*"
        return any(directory.glob(pattern)) if directory.is_dir() else False

    # -- the values -------------------------------------------------------------------

    def put(self, key: bytes, value: bytes) -> bool:
        """Keep `value` for a load of `key`; False where it could not be kept (larger
        than the whole budget, or the directory refused it)."""
        size = len(value)
        if size > self.max_bytes:
            return False
        name = _name(key)
        with self._lock:
            directory = self._own()
        # written outside the lock: the scheduler's `count` does not wait on the copy
        temporary = directory / f".{name}.{threading.get_ident()}"
        try:
            temporary.write_bytes(value)
            os.replace(temporary, directory / name)
        except OSError:
            _unlink(temporary)
            return False
        with self._lock:
            self._expire(directory, self._clock())
            old = self._written.pop(name, None)
            if old is not None:
                self._bytes -= old[0]
            while self._written and self._bytes + size > self.max_bytes:
                dropped, (dropped_size, _) = self._written.popitem(last=False)
                self._bytes -= dropped_size
                _unlink(directory / dropped)
            self._written[name] = (size, self._clock())
            self._bytes += size
        return True

    def take(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's value (taken: a value serves one load), None where not held."""
        directories = self._candidates()
        out: list[bytes | None] = []
        for key in keys:
            name, value = _name(key), None
            for directory in directories:
                path = directory / name
                try:
                    value = path.read_bytes()
                except OSError:
                    continue
                _unlink(path)
                break
            out.append(value)
        return out

    def count(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` this process kept and no load took yet."""
        with self._lock:
            if not self._written:
                return 0
            directory = self._own()
            self._expire(directory, self._clock())
            names = [_name(key) for key in keys]
            return sum(n in self._written and (directory / n).exists() for n in names)

    def clear(self) -> None:
        """Drop every value this process kept."""
        with self._lock:
            if self._pid != os.getpid():
                return
            directory = self.directory()
            for name in self._written:
                _unlink(directory / name)
            self._written.clear()
            self._bytes = 0

    @property
    def held_bytes(self) -> int:
        """Bytes kept and not dropped (taken ones count until they would expire)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._written)

    def _expire(self, directory: Path, now: float) -> None:
        written = self._written
        while written:
            name, (size, at) = next(iter(written.items()))
            if now - at <= self.max_age_s:
                return
            del written[name]
            self._bytes -= size
            _unlink(directory / name)


def _name(key: bytes) -> str:
    return "v" + xxhash.xxh3_128_hexdigest(key)


def _marker(key_base: bytes, pid: int) -> str:
    return f"s{xxhash.xxh3_64_hexdigest(key_base)}.{pid}"


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _remove_orphans(root: Path) -> None:
    """The directories of this user's schedulers that are gone (killed outright)."""
    prefix = f"{_PREFIX}{os.getuid()}-"
    with contextlib.suppress(OSError):
        for directory in root.glob(prefix + "*"):
            pid = directory.name.removeprefix(prefix)
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(directory, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# this process's: the scheduler's lookups and its workers' loads meet here
PREFETCHED = PrefetchedValues()


__all__ = ["MAX_AGE_S", "MAX_BYTES", "PREFETCHED", "PrefetchedValues", "default_root"]
