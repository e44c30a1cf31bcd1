"""The offload tiers a replay runs, built from its config: one object, typed seams.

The stack is what the replay (or the connector in front of it) talks to:

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.connector.chain import TierChain
from kvtier.offload import CPUOffloadingManager, FilterReusedOffloadingManager
from kvtier.offload.abstract import OffloadingEvent, OffloadingManager
from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.offload.disk_manager import DiskOffloadingManager
from kvtier.sim.metrics import TierCounters
from kvtier.sim.replay_config import ReplayConfig
from kvtier.sim.workload import Workload

# The chain's members (the local tiers, then Redis): the bytes plane routes jobs by them.
LOCAL, REMOTE = "local", "remote"

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

    def take_events(self) -> Iterator[OffloadingEvent]:
        yield from self.local.take_events()
        if self.remote_manager is not None:
            yield from self.remote_manager.take_events()

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
    bs, policy = workload.block_size, config.policy
    capacity = config.cpu_capacity(workload)
    cpu: OffloadingManager = CPUOffloadingManager(
        bs, capacity, cache_policy=policy, enable_events=True
    )
    capacities = {"cpu": capacity}
    stack = TierStack(cpu, cpu, capacities, policy, _closing=closing)
    if config.disk_blocks:
        disk: OffloadingManager
        if layout is not None:
            stack.disk_store = _disk_store(layout, config, closing)
            disk = stack.disk_store.manager(bs, cache_policy=policy, enable_events=True)
            stats = stack.disk_store.stats()
            if config.disk_dir is not None:
                stack.recovery = DiskRecovery(
                    str(stack.disk_store.directory), stats.recovered, stats.dropped_at_recovery
                )
        else:
            disk = DiskOffloadingManager(bs, config.disk_blocks, policy, enable_events=True)
        if config.store_threshold:  # the reuse filter as disk admission, as the cascade allows
            disk = FilterReusedOffloadingManager(disk, store_threshold=config.store_threshold)
        capacities["disk"] = config.disk_blocks
        stack.cascade = CascadeOffloadingManager(cpu, disk, enable_events=True)
        stack.manager = stack.local = stack.cascade
    elif config.store_threshold:
        stack.manager = stack.local = FilterReusedOffloadingManager(
            cpu, store_threshold=config.store_threshold
        )
    if config.redis_url is not None:
        from kvtier.remote.tier import RemoteTier

        namespace = config.redis_namespace or f"replay-{uuid.uuid4().hex}"
        key = layout if layout is not None else f"{namespace}/{workload.name}"
        stack.remote = RemoteTier.from_url(config.redis_url, key, block_size=bs)
        closing.callback(stack.remote.close)
        payload = None if layout is not None else config.remote_payload_bytes
        stack.remote_manager = stack.remote.manager(
            synthetic_payload_bytes=payload, enable_events=True
        )
        capacities["remote"] = 0
        # The step promotes (`kvtier.sim.step`), so that bytes follow with a bytes plane.
        members = [(LOCAL, stack.local), (REMOTE, stack.remote_manager)]
        stack.chain = TierChain(members, promote=False)
        stack.manager = stack.chain
    return stack


def _disk_store(layout: KVLayout, config: ReplayConfig, closing: contextlib.ExitStack) -> DiskStore:
    from kvtier.store.disk_store import DiskStore

    if config.disk_dir is not None:
        root = config.disk_dir
    else:
        root = closing.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-replay-disk-"))
    capacity = DiskStore.capacity_for(layout, config.disk_blocks)
    # No fsync: a replay checks that the right bytes come back, not crash durability
    # (the disk tier's own tests do), and an fsync per block would dominate the run.
    store = DiskStore(root, layout, capacity, fsync=False)
    closing.callback(store.close)
    return store
