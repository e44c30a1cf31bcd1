"""Building the offload tiers of a replay from its config, and reading their tallies.

One CPU tier is the common case and stays a bare manager (the fast path the
golden figures and the benchmark use). A remote tier below it turns the stack into
a `TierChain` (prefix continued tier by tier, write-through, promotion on load);
each replay gets its own key namespace so repeated runs never see each other's
blocks, unless a namespace is given (two engines sharing one cache).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.connector.chain import TierChain, TierTally
from kvtier.offload.abstract import LoadStoreSpec, OffloadingManager, PrepareStoreOutput
from kvtier.sim.metrics import TierCounters, TierStats
from kvtier.sim.workload import Workload
from kvtier.types import BlockHash

if TYPE_CHECKING:
    from kvtier.sim.replay import ReplayConfig


class MediumTally(OffloadingManager):
    """Forwards to a multi-medium manager (the CPU+disk cascade) and tallies per medium:
    hits from its load specs' positions, stores and evictions from its events."""

    def __init__(self, inner: OffloadingManager, media: Sequence[str]) -> None:
        self.inner = inner
        self.tallies = {m: TierTally() for m in media}

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        return self.inner.lookup(block_hashes)

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        spec = self.inner.prepare_load(block_hashes)
        for medium, tally in self.tallies.items():
            tally.hit_blocks += len(getattr(spec, f"{medium.lower()}_positions", ()))
        self._drain()
        return spec

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        self.inner.touch(block_hashes)

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        self.inner.complete_load(block_hashes)
        self._drain()

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        out = self.inner.prepare_store(block_hashes)
        if out is None:
            for tally in self.tallies.values():
                tally.store_rejections += 1
        self._drain()
        return out

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        self.inner.complete_store(block_hashes, success)
        self._drain()

    def _drain(self) -> None:
        for event in self.inner.take_events():
            tally = self.tallies.get(event.medium)
            if tally is not None:
                if event.removed:
                    tally.evictions += len(event.block_hashes)
                else:
                    tally.stores += len(event.block_hashes)


@dataclass
class OffloadTiers:
    manager: OffloadingManager
    cpu_capacity: int
    policy: str
    chain: TierChain | None = None
    remote: Any = None  # kvtier.remote.RemoteTier, imported only when asked for

    local: MediumTally | None = None
    disk_capacity: int = 0

    def _tallies(self) -> list[tuple[str, TierTally]]:
        named: list[tuple[str, TierTally]] = []
        if self.local is not None:
            named += [(medium.lower(), t) for medium, t in self.local.tallies.items()]
        if self.chain is not None:
            named = named or [("cpu", self.chain.tallies["cpu"])]
            named += [(n, self.chain.tallies[n]) for n, _ in self.chain.tiers[1:]]
        return named

    def stats(self, total: TierCounters, block_refs: int, block_size: int) -> list[TierStats]:
        """Per-tier figures: the replay's own tally for one tier, the tiers' otherwise."""
        if self.chain is None and self.local is None:
            return [total.freeze(block_refs)]
        sizes = {"cpu": self.cpu_capacity, "disk": self.disk_capacity}
        result = []
        for name, t in self._tallies():
            c = TierCounters(
                name,
                sizes.get(name, 0),
                self.policy if name in sizes else "server",
                hit_blocks=t.hit_blocks,
                hit_tokens=t.hit_blocks * block_size,
                stores=t.stores,
                evictions=t.evictions,
                store_rejections=t.store_rejections,
            )
            if name == "remote" and self.remote is not None:
                s = self.remote.stats
                c.stores = s.stored_blocks  # written, not just planned: Redis may be down
                c.bytes_stored, c.bytes_loaded = s.stored_bytes, s.loaded_bytes
                c.checksum_failures = s.corrupt_blocks
                c.errors = s.errors + s.skipped_calls
            result.append(c.freeze(block_refs))
        return result

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()


def build_tiers(
    workload: Workload, config: ReplayConfig, disk_store: Any = None, layout: Any = None
) -> OffloadTiers:
    """`disk_store`: a data plane's `DiskStore`, whose manager then serves as the disk tier;
    `layout`: the data plane's `KVLayout` (real bytes in Redis: no placeholders, and no
    promotion, whose copy into CPU slots the chain would make without bytes)."""
    from kvtier.offload import CPUOffloadingManager, FilterReusedOffloadingManager

    capacity = config.cpu_capacity(workload)
    bs = workload.block_size
    local = None
    manager: OffloadingManager
    if config.disk_blocks:
        manager = local = _cascade(bs, capacity, config, disk_store)
    else:
        manager = CPUOffloadingManager(bs, capacity, cache_policy=config.policy)
        if config.store_threshold:
            manager = FilterReusedOffloadingManager(manager, store_threshold=config.store_threshold)
    tiers = OffloadTiers(
        manager, capacity, config.policy, local=local, disk_capacity=config.disk_blocks
    )
    if config.redis_url is not None:
        from kvtier.remote.tier import RemoteTier

        namespace = config.redis_namespace or f"replay-{uuid.uuid4().hex}"
        key = layout if layout is not None else f"{namespace}/{workload.name}"
        tiers.remote = RemoteTier.from_url(config.redis_url, key, block_size=bs)
        payload = None if layout is not None else config.remote_payload_bytes
        remote = tiers.remote.manager(synthetic_payload_bytes=payload)
        chain = TierChain([("cpu", tiers.manager), ("remote", remote)], layout is None)
        tiers.chain = tiers.manager = chain
    return tiers


def _cascade(bs: int, capacity: int, config: ReplayConfig, disk_store: Any) -> MediumTally:
    """CPU memory then local disk (demotion on CPU eviction, promotion on load)."""
    from kvtier.offload import CPUOffloadingManager, FilterReusedOffloadingManager
    from kvtier.offload.cascade import CascadeOffloadingManager
    from kvtier.offload.disk import DiskOffloadingManager

    cpu = CPUOffloadingManager(bs, capacity, cache_policy=config.policy, enable_events=True)
    disk: OffloadingManager
    if disk_store is not None:  # evictions delete the files
        disk = disk_store.manager(bs, cache_policy=config.policy, enable_events=True)
    else:
        disk = DiskOffloadingManager(
            bs, config.disk_blocks, cache_policy=config.policy, enable_events=True
        )
    if config.store_threshold:  # the reuse filter as disk admission, as the cascade allows
        disk = FilterReusedOffloadingManager(disk, store_threshold=config.store_threshold)
    cascade = CascadeOffloadingManager(cpu, disk, enable_events=True)
    return MediumTally(cascade, ("CPU", "DISK"))
