"""Building the offload tiers of a replay from its config, and reading their tallies.

One CPU tier is the common case and stays a bare manager (the fast path the
golden figures and the benchmark use). A remote tier below it turns the stack into
a `TierChain` (prefix continued tier by tier, write-through, promotion on load);
each replay gets its own key namespace so repeated runs never see each other's
blocks, unless a namespace is given (two engines sharing one cache).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.connector.chain import TierChain
from kvtier.offload.abstract import OffloadingManager
from kvtier.sim.metrics import TierCounters, TierStats
from kvtier.sim.workload import Workload

if TYPE_CHECKING:
    from kvtier.sim.replay import ReplayConfig


@dataclass
class OffloadTiers:
    manager: OffloadingManager
    cpu_capacity: int
    policy: str
    chain: TierChain | None = None
    remote: Any = None  # kvtier.remote.RemoteTier, imported only when asked for

    def stats(self, total: TierCounters, block_refs: int, block_size: int) -> list[TierStats]:
        """Per-tier figures: the replay's own tally for one tier, the chain's otherwise."""
        if self.chain is None:
            return [total.freeze(block_refs)]
        result = []
        for name, _ in self.chain.tiers:
            t = self.chain.tallies[name]
            c = TierCounters(
                name,
                self.cpu_capacity if name == "cpu" else 0,
                self.policy if name == "cpu" else "server",
                hit_blocks=t.hit_blocks,
                hit_tokens=t.hit_blocks * block_size,
                stores=t.stores,
                evictions=t.evictions,
                store_rejections=t.store_rejections,
            )
            if name == "remote" and self.remote is not None:
                s = self.remote.stats
                c.bytes_stored, c.bytes_loaded = s.stored_bytes, s.loaded_bytes
                c.checksum_failures = s.corrupt_blocks
            result.append(c.freeze(block_refs))
        return result

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()


def build_tiers(workload: Workload, config: ReplayConfig) -> OffloadTiers:
    from kvtier.offload import CPUOffloadingManager, FilterReusedOffloadingManager

    capacity = config.cpu_capacity(workload)
    bs = workload.block_size
    cpu: OffloadingManager = CPUOffloadingManager(bs, capacity, cache_policy=config.policy)
    if config.store_threshold:
        cpu = FilterReusedOffloadingManager(cpu, store_threshold=config.store_threshold)
    if config.redis_url is None:
        return OffloadTiers(cpu, capacity, config.policy)
    from kvtier.remote.tier import RemoteTier

    namespace = config.redis_namespace or f"replay-{uuid.uuid4().hex}"
    remote = RemoteTier.from_url(config.redis_url, f"{namespace}/{workload.name}", block_size=bs)
    manager = remote.manager(synthetic_payload_bytes=config.remote_payload_bytes)
    chain = TierChain([("cpu", cpu), ("remote", manager)])
    return OffloadTiers(chain, capacity, config.policy, chain=chain, remote=remote)
