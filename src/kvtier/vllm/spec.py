"""`KvtierOffloadingSpec`: what vLLM's offloading connector loads from kvtier.

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
      "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier.vllm", "cpu_bytes_to_use": 8000000000}}'

The spec is built once for the scheduler and once per worker (maybe in different
processes), so everything it decides comes from the config alone: the block layout of
each worker's shard (and with it the fingerprint that names its disk directory and
Redis keys, see `engine_shape`), the number of CPU slots and disk blocks, the same on
every worker of a tensor-parallel engine. Every check that can fail runs in
`__init__`, so a wrong key, an unsupported vLLM or an unsupported engine shape stops
the engine at start with one message.
"""

from __future__ import annotations

import contextvars
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.offload import CPUOffloadingManager, FilterReusedOffloadingManager
from kvtier.offload.abstract import OffloadingManager as KvtierManager
from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.offload.disk_manager import DiskOffloadingManager
from kvtier.store.diskformat import MAX_KEY_BYTES, BlockHeader
from kvtier.types import BlockHash
from kvtier.vllm.engine_shape import (
    check_engine,
    layout_for,
    recovered_blocks,
    recovered_on_every_rank,
    shard_root,
)
from kvtier.vllm.extra_config import KvtierVllmConfig, parse_extra_config
from kvtier.vllm.kvtier_manager import KvtierOffloadingManager
from kvtier.vllm.kvtier_worker import KvtierOffloadingWorker
from kvtier.vllm.shard_lookup import EveryShardLookup
from kvtier.vllm.version import check_vllm_version

# Set while KvtierConnector builds its spec: only that connector reports failed
# transfers to vLLM's recompute path (vLLM's own asserts that none fail).
UNDER_KVTIER_CONNECTOR: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvtier_under_kvtier_connector", default=False
)


class KvtierOffloadingSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        check_vllm_version()
        super().__init__(config)
        self.kvtier: KvtierVllmConfig = parse_extra_config(self.extra_config)
        self.report_failures = UNDER_KVTIER_CONNECTOR.get()
        check_engine(config, self.kvtier, self.report_failures)
        self.layout = layout_for(config)
        self.block_size = config.groups[0].tokens_per_block
        self.num_cpu_slots = self.kvtier.cpu_bytes_to_use // self.layout.bytes_per_block
        if self.num_cpu_slots < 1:
            raise ValueError(
                f"cpu_bytes_to_use {self.kvtier.cpu_bytes_to_use} is below one block of "
                f"this model ({self.layout.bytes_per_block} bytes)"
            )
        file_bytes = BlockHeader.size_for(MAX_KEY_BYTES) + self.layout.bytes_per_block
        self.num_disk_blocks = (self.kvtier.disk_bytes_to_use or 0) // file_bytes
        if self.kvtier.has_disk and self.num_disk_blocks < 1:
            raise ValueError(
                f"disk_bytes_to_use {self.kvtier.disk_bytes_to_use} is below one block "
                f"file of this model ({file_bytes} bytes)"
            )
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    # --- scheduler side ------------------------------------------------------

    def get_manager(self) -> KvtierOffloadingManager:
        if self._manager is None:
            self._manager = self._build_manager()
        return self._manager

    def _build_manager(self) -> KvtierOffloadingManager:
        cfg, events = self.kvtier, self.kv_events_config.enable_kv_cache_events
        cpu: KvtierManager = CPUOffloadingManager(
            self.block_size,
            self.num_cpu_slots,
            cache_policy=cfg.eviction_policy,
            enable_events=events,
        )
        discards: list[BlockHash] = []
        local = cpu
        if cfg.disk_path is not None:
            disk = DiskOffloadingManager(
                self.block_size,
                self.num_disk_blocks,
                cfg.eviction_policy,
                events,
                on_free=discards.extend,
            )
            whole, partial = recovered_on_every_rank(cfg.disk_path, self.config)
            discards.extend(partial)  # a shard some rank lacks is never loaded: deleted
            discards.extend(disk.adopt(whole))
            lower: KvtierManager = disk
            if cfg.store_threshold >= 2:  # admission to the disk, as the replay does
                lower = FilterReusedOffloadingManager(disk, store_threshold=cfg.store_threshold)
            local = CascadeOffloadingManager(
                cpu, lower, disk_writes=cfg.disk_writes, enable_events=events
            )
        elif cfg.store_threshold >= 2:
            local = FilterReusedOffloadingManager(cpu, store_threshold=cfg.store_threshold)
        remote, close = self._scheduler_remote(events)

        def take_discards() -> list[BlockHash]:
            taken = list(discards)
            discards.clear()
            return taken

        return KvtierOffloadingManager(
            local,
            remote,
            whole_keys=len(self.config.groups) > 1,
            enable_events=events,
            on_close=close,
            take_discards=take_discards,
        )

    def _scheduler_remote(self, events: bool) -> tuple[KvtierManager | None, Any]:
        """The Redis tier's manager on the scheduler side (looking up every worker's
        shard, see `shard_lookup`), and what closes its connections."""
        tiers = [self._open_remote(rank) for rank in range(self.config.parallel.world_size)]
        if tiers[0] is None:
            return None, None
        first = tiers[0].manager(enable_events=events, async_lookup=True)
        others = [tier.manager(async_lookup=True) for tier in tiers[1:]]

        def close() -> None:
            for tier in tiers:
                tier.close()

        return (EveryShardLookup(first, others) if others else first), close

    def _open_remote(self, rank: int | None = None) -> Any:
        """The Redis tier under the keys of one worker's shards (default this one's)."""
        cfg = self.kvtier
        if cfg.redis_url is None:
            return None
        from kvtier.remote.tier import RemoteTier

        return RemoteTier.from_url(
            cfg.redis_url,
            self.layout if rank is None else layout_for(self.config, rank),
            block_size=self.block_size,
            socket_timeout_s=cfg.redis_socket_timeout_s,
            connect_timeout_s=cfg.redis_connect_timeout_s,
            ttl_s=cfg.redis_ttl_s,
            key_prefix=cfg.redis_key_prefix,
        )

    # --- worker side -----------------------------------------------------------

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KvtierOffloadingWorker:
        if self._worker is None:
            self._worker = KvtierOffloadingWorker(
                self.kvtier,
                self.layout,
                kv_caches,
                disk_root=shard_root(self.kvtier.disk_path, self.config)
                if self.kvtier.disk_path is not None
                else None,
                num_cpu_slots=self.num_cpu_slots,
                num_disk_blocks=self.num_disk_blocks,
                remote=self._open_remote(),
                report_failures=self.report_failures,
            )
        return self._worker


__all__ = ["KvtierOffloadingSpec", "layout_for", "recovered_blocks"]
