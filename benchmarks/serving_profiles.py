"""bench_serving's tier profiles: what the tiers below kvtier's CPU tier do during a run.

A profile names one kvtier server and, for a Redis tier, how the link to it is shaped
(`kvtier.remote.shaping_proxy` in front of a real redis-server):

    cpu                               kvtier's CPU tier alone (the healthy default)
    alone                             the control: a second vLLM alone in kvtier's place
                                      (same config, started with the others), so the
                                      run's own noise floor between two equal servers
    redis                             a CPU tier over a Redis tier on a healthy link
    redis:delay_ms=50                 every Redis round trip 50 ms longer
    redis:rate_mb_s=20                the link capped at 20 MB/s each way
    redis:stall_after=8               Redis stops answering after the run's 8th request
                                      (until the run ends)
    disk                              a CPU tier over a local disk tier
    disk:read_ms=50:write_ms=20       every block file the disk tier reads (writes) held
                                      up this long in its I/O threads (a disk shared
                                      with other writers; `kvtier.store.slow_io`)
    disk:demote=1                     the disk written on CPU eviction (`disk_writes:
                                      demote`) rather than through every CPU store

Fields combine (`redis:delay_ms=50:rate_mb_s=20`). Every profile runs beside vLLM alone
on the same workload, rates and warm-up (bench_serving). The Redis and disk servers' CPU
tiers hold one pool's worth of blocks (`SMALL_CPU_POOLS`), so that a reuse workload's
returning prefixes are also asked of the tier below and its load-or-recompute
decisions show; their disk tier or Redis holds the rest. The Redis server's calls may
take `REDIS_SOCKET_TIMEOUT_S` (an operator of a slow Redis raises the 0.25 s default; a
stalled one then costs that long per call until the circuit breaker opens). Each disk
profile has a server of its own (the slow I/O is set in its worker's environment).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.remote.proxy_process import ProxyProcess
from kvtier.remote.shaping_proxy import LinkProfile, ShapingProxy
from kvtier.store.slow_io import ENV as DISK_IO_ENV

SMALL_CPU_POOLS = 1
REDIS_SOCKET_TIMEOUT_S = 2.0
FIELDS = {
    "redis": {
        "delay_ms": "milliseconds added to each round trip, a number >= 0",
        "rate_mb_s": "the link's cap each way in MB/s, a number > 0",
        "stall_after": "requests answered before Redis stalls, an integer >= 0",
    },
    "disk": {
        "read_ms": "milliseconds each block file's read is held up, a number >= 0",
        "write_ms": "milliseconds each block file's write is held up, a number >= 0",
        "demote": "1: written on CPU eviction (disk_writes: demote), 0: write-through",
    },
}


@dataclass(frozen=True)
class Rig:
    """How the stand-in for a remote Redis (the redis-server and the shaping proxy, each
    a process of its own) shares the engines' machine: `nice`, its niceness; `apart`:
    off the cores the engines' workers compute on (onto those vLLM keeps for its
    scheduler and the connector's threads), as a Redis on another machine takes none of
    the model's compute. vLLM alone never drives it, so wherever it takes compute, it
    is counted against kvtier alone."""

    nice: int = 0
    apart: bool = True


DEFAULT_RIG = Rig()


@dataclass(frozen=True)
class TierProfile:
    """One profile (see the module docstring); `name` is the text it was read from."""

    name: str
    redis: bool = False
    control: bool = False
    delay_s: float = 0.0
    rate_bytes_per_s: float | None = None
    stall_after: int | None = None
    disk: bool = False
    read_s: float = 0.0
    write_s: float = 0.0
    demote: bool = False

    @property
    def server(self) -> str:
        """The server in kvtier's place (the Redis profiles share one; a disk profile
        has its own, its slow I/O set in the environment)."""
        if self.control:
            return "vllm_control"
        if self.disk:
            return "kvtier_" + re.sub(r"[^a-z0-9]+", "_", self.name.lower()).strip("_")
        return "kvtier_redis" if self.redis else "kvtier"

    @property
    def env(self) -> dict[str, str]:
        """The server's environment for the profile (`KVTIER_DISK_IO_DELAY`)."""
        if not (self.read_s or self.write_s):
            return {}
        return {DISK_IO_ENV: f"read={self.read_s!r},write={self.write_s!r}"}

    @property
    def link(self) -> LinkProfile:
        return LinkProfile.round_trip(self.delay_s, self.rate_bytes_per_s)

    def stall_hook(self, proxy: ShapingProxy | ProxyProcess | None) -> Callable[[int], None] | None:
        """A load client's `before(i)`: stalls the link before request `stall_after`."""
        after = self.stall_after
        if after is None or proxy is None:
            return None

        def before(i: int) -> None:
            if i == after:
                proxy.stall()

        return before


def parse_profile(text: str) -> TierProfile:
    """`text` as a profile; a ValueError names the profile, the part and what is allowed."""
    kind, *fields = text.strip().split(":")
    if kind == "cpu" and not fields:
        return TierProfile(text)
    if kind == "alone" and not fields:
        return TierProfile(text, control=True)
    if kind not in FIELDS:
        kinds = "; ".join(
            f"{k}[:FIELD=VALUE...] with FIELD one of {', '.join(f)}" for k, f in FIELDS.items()
        )
        raise ValueError(
            f"tier profile {text!r}: unknown kind {kind!r}; allowed: cpu, alone, {kinds}"
        )
    allowed = FIELDS[kind]
    values: dict[str, float] = {}
    for field in fields:
        key, sep, raw = field.partition("=")
        if key not in allowed or not sep:
            raise ValueError(
                f"tier profile {text!r}: {field!r} is not FIELD=VALUE with FIELD one of "
                f"{', '.join(allowed)}"
            )
        values[key] = _number(text, key, raw, allowed[key])
    if kind == "disk":
        read, write = values.get("read_ms", 0.0), values.get("write_ms", 0.0)
        demote = bool(values.get("demote", 0.0))
        return TierProfile(text, disk=True, read_s=read / 1000, write_s=write / 1000, demote=demote)
    stall = values.get("stall_after")
    return TierProfile(
        text,
        redis=True,
        delay_s=values.get("delay_ms", 0.0) / 1000,
        rate_bytes_per_s=values["rate_mb_s"] * 1e6 if "rate_mb_s" in values else None,
        stall_after=None if stall is None else int(stall),
    )


def _number(profile: str, key: str, raw: str, what: str) -> float:
    allowed = f"tier profile {profile!r}: {key}={raw!r}; {what}"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(allowed) from None
    bad = (
        not math.isfinite(value)
        or value < 0
        or (key == "rate_mb_s" and value == 0)
        or (key == "stall_after" and value != int(value))
        or (key == "demote" and value not in (0, 1))
    )
    if bad:
        raise ValueError(allowed)
    return value


def parse_profiles(text: str) -> list[TierProfile]:
    """A comma list of profiles, each once."""
    profiles = [parse_profile(part) for part in text.split(",") if part.strip()]
    names = [p.name for p in profiles]
    if not profiles or len(set(names)) != len(names):
        raise ValueError(f"tier profiles {text!r}: give at least one, each once")
    return profiles
