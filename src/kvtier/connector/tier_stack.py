"""The one builder of a tier stack: the replay, the vLLM plug-in and the benchmarks call it.

A replay predicts an engine only if both run the same objects, so the managers below
the accelerator are put together here and nowhere else:

- the CPU tier, its policy, and the reuse filter as its admission (or, with a disk
  tier, as the disk's admission: the cascade then stores every block in CPU memory
  and the filter decides what reaches the disk);
- the disk tier under the CPU tier (the cascade, demoting on eviction or writing
  through), reopened over the blocks a directory already holds;
- the shared Redis tier, written through and promoting on load.

How local and remote are joined is the caller's (a replay's `TierChain`, or the vLLM
adapter, which answers key by key); both keep the chain's member names below.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.connector.tier_config import (
    DiskWrites,
    TierConfig,
    check_disk_writes,
    check_policy,
    check_store_threshold,
)
from kvtier.offload import CPUOffloadingManager, FilterReusedOffloadingManager
from kvtier.offload.abstract import OffloadingEvent, OffloadingManager
from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.offload.disk_manager import DiskOffloadingManager
from kvtier.types import BlockHash
from kvtier.validate import whole_number

if TYPE_CHECKING:
    from kvtier.remote.remote_manager import RemoteOffloadingManager
    from kvtier.remote.tier import HasFingerprint, RemoteTier

# The members a stack's local and remote parts go by when joined (a chain's names).
LOCAL, REMOTE = "local", "remote"


@dataclass(frozen=True)
class StackConfig:
    """A tier stack in blocks: what `build_tiers` builds, however the caller sized it."""

    block_size: int
    cpu_blocks: int
    policy: str = "lru"
    store_threshold: int = 0
    disk_blocks: int = 0
    disk_writes: DiskWrites = "demote"
    redis_url: str | None = None
    redis_options: Mapping[str, Any] = field(default_factory=dict)  # RemoteConfig fields
    enable_events: bool = True

    def __post_init__(self) -> None:
        whole_number("block_size", self.block_size, minimum=1)
        whole_number("cpu_blocks", self.cpu_blocks, minimum=0)
        whole_number("disk_blocks", self.disk_blocks, minimum=0)
        check_policy("eviction_policy", self.policy)
        check_store_threshold("store_threshold", self.store_threshold)
        check_disk_writes("disk_writes", self.disk_writes)

    @classmethod
    def from_tier_config(
        cls, config: TierConfig, block_size: int, bytes_per_block: int, enable_events: bool = True
    ) -> StackConfig:
        """The stack an engine builds from its extra config, its block size (tokens) and
        one block's KV bytes."""
        return cls(
            block_size=block_size,
            cpu_blocks=config.cpu_blocks(bytes_per_block),
            policy=config.eviction_policy,
            store_threshold=config.store_threshold,
            disk_blocks=config.disk_blocks(bytes_per_block),
            disk_writes=config.disk_writes,
            redis_url=config.redis_url,
            redis_options=config.redis_options() if config.has_redis else {},
            enable_events=enable_events,
        )

    @property
    def filtered(self) -> bool:
        return self.store_threshold >= 2

    def describe(self) -> str:
        """The stack in one line, as a report names it."""
        parts = [f"cpu {self.cpu_blocks:,} blocks ({self.policy})"]
        if self.disk_blocks:
            parts.append(f"disk {self.disk_blocks:,} blocks ({self.policy}, {self.disk_writes})")
        if self.redis_url is not None:
            parts.append("redis (write-through, promote on load)")
        text = " -> ".join(parts)
        if self.filtered:
            where = "disk" if self.disk_blocks else "cpu"
            text += f"; {where} admits blocks offered {self.store_threshold}+ times"
        return text


@dataclass(frozen=True)
class DiskBacking:
    """What a disk tier's manager starts from: blocks its directory holds (oldest first)
    and who deletes the files the manager lets go of."""

    recovered: Sequence[BlockHash] = ()
    on_free: Callable[[Sequence[BlockHash]], None] | None = None
    # a directory other engines write too: whether a block it does not know is there
    probe: Callable[[BlockHash], bool] | None = None


@dataclass
class Tiers:
    config: StackConfig
    cpu: OffloadingManager
    local: OffloadingManager  # the CPU tier (maybe behind its filter), or the cascade
    disk: OffloadingManager | None = None
    cascade: CascadeOffloadingManager | None = None
    remote: RemoteTier | None = None
    remote_manager: RemoteOffloadingManager | None = None
    _closing: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return take_events(self.local, self.remote_manager)

    def close(self) -> None:
        self._closing.close()


def build_tiers(
    config: StackConfig,
    *,
    disk: DiskBacking | None = None,
    remote_key: str | bytes | HasFingerprint | None = None,
    remote_payload_bytes: int | None = None,
    async_lookup: bool = False,
    remote_heads: int | None = None,
    remote_group_heads: int | None = None,
) -> Tiers:
    """The stack `config` describes.

    `disk`: the disk tier's starting point (none: an empty tier whose files nobody
    deletes, for bookkeeping-only replays). `remote_key`: what namespaces the blocks in
    Redis (a layout, or its fingerprint); `remote_payload_bytes`: placeholder bytes per
    block when no data plane writes real ones; `async_lookup`: Redis lookups answer
    "ask again" while their round trip is in flight (an engine's scheduler never waits);
    `remote_heads`: Redis keeps each block by KV head, this many of them, the engine's
    workers writing `remote_group_heads` a value (`kvtier.remote.head_keys`: engines of
    every tensor-parallel size share them).
    """
    events, bs, policy = config.enable_events, config.block_size, config.policy
    # freed slots first: a host slot is resident from its first write on (see CPUBackend)
    cpu: OffloadingManager = CPUOffloadingManager(
        bs, config.cpu_blocks, cache_policy=policy, enable_events=events, reuse_freed_first=True
    )
    tiers = Tiers(config, cpu, cpu)
    if config.disk_blocks:
        backing = disk or DiskBacking()
        tiers.disk = DiskOffloadingManager.reopened(
            bs,
            config.disk_blocks,
            backing.recovered,
            backing.on_free or _ignore,
            policy,
            events,
            backing.probe,
        )
        lower: OffloadingManager = tiers.disk
        if config.filtered:
            lower = _reuse_filter(lower, config.store_threshold)
        tiers.cascade = CascadeOffloadingManager(
            cpu, lower, disk_writes=config.disk_writes, enable_events=events
        )
        tiers.local = tiers.cascade
    elif config.filtered:
        tiers.local = _reuse_filter(cpu, config.store_threshold)
    if config.redis_url is not None:
        from kvtier.remote.tier import RemoteTier

        if remote_key is None:
            raise ValueError("a Redis tier needs remote_key: the layout that names its blocks")
        try:
            tiers.remote = RemoteTier.from_url(
                config.redis_url,
                remote_key,
                block_size=bs,
                heads=remote_heads,
                group_heads=remote_group_heads,
                **config.redis_options,
            )
        except BaseException:
            tiers.close()
            raise
        tiers._closing.callback(tiers.remote.close)
        tiers.remote_manager = tiers.remote.manager(
            enable_events=events,
            synthetic_payload_bytes=remote_payload_bytes,
            async_lookup=async_lookup,
        )
    return tiers


def take_events(
    local: OffloadingManager, remote: OffloadingManager | None
) -> Iterable[OffloadingEvent]:
    """The events of a stack's local and remote parts, local first, taken at the call
    (not as they are iterated). A replay drains them several times per request: the
    local tier's own iterable is passed on as it is when there is no remote part."""
    if remote is None:
        return local.take_events()
    return [*local.take_events(), *remote.take_events()]


def _reuse_filter(manager: OffloadingManager, threshold: int) -> OffloadingManager:
    """The filter counts store offers, not lookups: an engine looks a request's blocks up
    one by one only to its first miss, and again on every step the request waits, so its
    lookups count scheduling, not reuse; every caller offers a computed block once."""
    return FilterReusedOffloadingManager(manager, threshold, count_store_offers=True)


def _ignore(block_hashes: Sequence[BlockHash]) -> None:
    """Nothing to delete: a bookkeeping-only disk tier has no files."""
