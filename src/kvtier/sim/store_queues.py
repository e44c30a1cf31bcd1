"""The replay's store queues: a tier that falls behind sheds stores, as the engine's do.

In an engine each tier's stores queue behind its transfers (CPU copies, disk writes,
Redis round trips), and a queue past its bound in bytes sheds the next store rather
than queueing it (`*_store_queue_bytes`, counted in `kvtier_shed_blocks`; never an
error). A replay that overlaps requests (`--concurrent`) can say how often that happens
for a trace, a capacity and a write rate: each member of the tier chain ("local": the
CPU tier or the CPU -> disk cascade; "remote": Redis) is one server that writes a block
in `ms_per_block` of the replay's virtual time; a store part arriving while the
member's backlog plus its own blocks exceed `max_blocks` is shed. A member whose queue
is empty takes any store (it is not behind), as the engine's worker does.

A shed part completes as a store that did not happen: the tier keeps nothing of it,
its blocks stay absent, and the ledger counts them (`shed_blocks`), not as errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.connector.tier_stack import LOCAL, REMOTE
from kvtier.validate import key_values

MEMBERS = (LOCAL, REMOTE)


def _rate(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}={value!r}; a number of milliseconds >= 0")
    if not 0 <= value < math.inf:
        raise ValueError(f"{name}={value!r}; a finite number of milliseconds >= 0")


def _bound(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}; a whole number of blocks >= 1, or none (unbounded)")


@dataclass(frozen=True)
class StoreQueueModel:
    """Per chain member: milliseconds to write one block, and the most blocks its queue
    holds (None: unbounded, nothing is shed)."""

    local_ms_per_block: float = 0.0
    remote_ms_per_block: float = 0.0
    local_max_blocks: int | None = None
    remote_max_blocks: int | None = None

    def __post_init__(self) -> None:
        for member in MEMBERS:
            _rate(f"{member}_ms_per_block", getattr(self, f"{member}_ms_per_block"))
            _bound(f"{member}_max_blocks", getattr(self, f"{member}_max_blocks"))

    @classmethod
    def parse(cls, rates: str, bounds: str) -> StoreQueueModel:
        """The CLI's form: `rates` "local=MS,remote=MS", `bounds` "local=N,remote=N"
        (either may be empty; a member left out writes instantly / is unbounded)."""
        fields: dict[str, float | int] = {}
        for text, suffix, kind, what in (
            (rates, "ms_per_block", float, "MS"),
            (bounds, "max_blocks", int, "BLOCKS"),
        ):
            for member, value in key_values(text, dict.fromkeys(MEMBERS, what)).items():
                try:
                    fields[f"{member}_{suffix}"] = kind(value)
                except ValueError:
                    what = "milliseconds" if kind is float else "a whole number of blocks"
                    raise ValueError(f"{member}={value!r}; {what}") from None
        return cls(**fields)  # type: ignore[arg-type]

    def sheds(self) -> bool:
        """Whether any member can shed at all (a bound and a write time)."""
        return any(
            getattr(self, f"{m}_max_blocks") is not None and getattr(self, f"{m}_ms_per_block")
            for m in MEMBERS
        )


class StoreQueues:
    """The members' backlogs in virtual time (`clock`: the replay's now, in ms)."""

    def __init__(self, model: StoreQueueModel, clock: Callable[[], float]) -> None:
        self.model = model
        self.clock = clock
        self._busy_until = dict.fromkeys(MEMBERS, 0.0)

    def admit(self, member: str, num_blocks: int) -> bool:
        """Queue a store part of `num_blocks` blocks for `member`; False: shed."""
        ms = getattr(self.model, f"{member}_ms_per_block")
        bound = getattr(self.model, f"{member}_max_blocks")
        now = self.clock()
        busy_until = max(self._busy_until[member], now)
        backlog = (busy_until - now) / ms if ms else 0.0
        if bound is not None and backlog > 0 and backlog + num_blocks > bound:
            return False
        self._busy_until[member] = busy_until + num_blocks * ms
        return True
