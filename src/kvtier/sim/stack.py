"""The offload tiers a replay runs, built by kvtier's one builder from its config.

The tiers come from `kvtier.connector.tier_stack.build_tiers`, the same builder the
vLLM plug-in uses; this module adds what only a replay needs (the join, the
figures' names, a temporary or reopened disk directory). The stack is what the
replay (or the connector in front of it) talks to:

- the CPU tier alone: a bare manager (behind the reuse filter when asked);
- with a disk tier: the CPU->disk cascade (the filter then admits to disk);
- with a Redis tier: a `TierChain` of two members, "local" (the CPU tier or the
  cascade) and "remote" (write-through; the replay's step promotes on load).

Figures are kept per tier ("cpu", "disk", "remote"), named by the media the
managers report in their events and specs; the chain's members only route jobs.

Each replay gets its own Redis key namespace so repeated runs never see each
other's blocks, unless one is given (two engines sharing one cache). With real
bytes, the disk tier's files live in a temporary directory, or in `disk_dir`, which
then persists across runs (what the recovery scan found is reported).
"""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.connector.chain import TierChain
from kvtier.connector.tier_stack import LOCAL, REMOTE, DiskBacking, build_tiers, take_events
from kvtier.offload.abstract import OffloadingEvent, OffloadingManager
from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.sim.metrics import TierCounters
from kvtier.sim.replay_config import REPLAY_DISK_PREFIX, ReplayConfig
from kvtier.sim.workload import Workload

__all__ = ["LOCAL", "REMOTE", "DiskRecovery", "TierStack", "build_stack"]

if TYPE_CHECKING:
    from kvtier.remote.tier import RemoteTier
    from kvtier.store.disk_store import DiskStore
    from kvtier.store.layout import KVLayout


@dataclass(frozen=True)
class DiskRecovery:
    """What reopening `--disk-dir` found: blocks kept and files deleted."""

    directory: str
    recovered_blocks: int
    dropped_files: int


@dataclass
class TierStack:
    manager: OffloadingManager  # the top: what lookups, loads and stores go to
    local: OffloadingManager  # the CPU tier, or the CPU->disk cascade
    capacities: dict[str, int]  # offload tier -> blocks, in order ("remote": 0, a server)
    policy: str
    cascade: CascadeOffloadingManager | None = None
    chain: TierChain | None = None
    remote: RemoteTier | None = None
    remote_manager: OffloadingManager | None = None
    disk_store: DiskStore | None = None
    recovery: DiskRecovery | None = None
    description: str = ""  # the stack built, in one line (`StackConfig.describe`)
    _closing: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.capacities)

    @property
    def local_names(self) -> tuple[str, ...]:
        return ("cpu", "disk") if self.cascade is not None else ("cpu",)

    def counters(self) -> list[TierCounters]:
        return [
            TierCounters(name, size, "server" if name == "remote" else self.policy)
            for name, size in self.capacities.items()
        ]

    def take_events(self) -> Iterable[OffloadingEvent]:
        return take_events(self.local, self.remote_manager)

    def refusals(self, top_refused: int) -> dict[str, int]:
        """Stores each tier refused: the chain knows per tier; a local stack refused
        `top_refused` times (the cascade refuses for both its media at once)."""
        out = dict.fromkeys(self.names, 0)
        if self.chain is None:
            for name in self.local_names:
                out[name] += top_refused
            return out
        for name, count in self.chain.rejections.items():
            for tier in self.local_names if name == LOCAL else (name,):
                out[tier] += count
        return out

    def close(self) -> None:
        self._closing.close()


def build_stack(
    workload: Workload, config: ReplayConfig, layout: KVLayout | None = None
) -> TierStack:
    """`layout`: the bytes plane's (real bytes: disk files and real Redis values)."""
    closing = contextlib.ExitStack()
    try:
        return _build(workload, config, layout, closing)
    except BaseException:
        closing.close()
        raise


def _build(
    workload: Workload, config: ReplayConfig, layout: KVLayout | None, closing: contextlib.ExitStack
) -> TierStack:
    stack_config = config.stack_config(workload)
    disk_store, backing = None, None
    if config.disk_blocks and layout is not None:
        disk_store = _disk_store(layout, config, closing)
        backing = DiskBacking(disk_store.recovered, disk_store.discard)
    remote_key: KVLayout | str | None = None
    if config.redis_url is not None:
        namespace = config.redis_namespace or f"replay-{uuid.uuid4().hex}"
        remote_key = layout if layout is not None else f"{namespace}/{workload.name}"
    tiers = build_tiers(
        stack_config,
        disk=backing,
        remote_key=remote_key,
        remote_payload_bytes=None if layout is not None else config.remote_payload_bytes,
    )
    closing.callback(tiers.close)
    capacities = {"cpu": stack_config.cpu_blocks}
    if tiers.disk is not None:
        capacities["disk"] = stack_config.disk_blocks
    stack = TierStack(
        tiers.local,
        tiers.local,
        capacities,
        config.policy,
        cascade=tiers.cascade,
        remote=tiers.remote,
        remote_manager=tiers.remote_manager,
        disk_store=disk_store,
        description=stack_config.describe(),
        _closing=closing,
    )
    if disk_store is not None and config.disk_dir is not None:
        stats = disk_store.stats()
        stack.recovery = DiskRecovery(
            str(disk_store.directory), stats.recovered, stats.dropped_at_recovery
        )
    if tiers.remote_manager is not None:
        capacities["remote"] = 0
        # The step promotes (`kvtier.sim.step`), so that bytes follow with a bytes plane.
        members = [(LOCAL, stack.local), (REMOTE, tiers.remote_manager)]
        stack.chain = TierChain(members, promote=False)
        stack.manager = stack.chain
    return stack


def _disk_store(layout: KVLayout, config: ReplayConfig, closing: contextlib.ExitStack) -> DiskStore:
    from kvtier.store.disk_store import DiskStore

    if config.disk_dir is not None:
        root = config.disk_dir
    else:
        root = closing.enter_context(tempfile.TemporaryDirectory(prefix=REPLAY_DISK_PREFIX))
    capacity = DiskStore.capacity_for(layout, config.disk_blocks)
    # No fsync: a replay checks that the right bytes come back, not crash durability
    # (the disk tier's own tests do), and an fsync per block would dominate the run.
    store = DiskStore(root, layout, capacity, fsync=False)
    closing.callback(store.close)
    return store
