"""`KvtierOffloadingSpec`: what vLLM's offloading connector loads from kvtier.

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
      "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier.vllm", "cpu_bytes_to_use": 8000000000}}'

The spec is built once for the scheduler and once per worker (maybe in different
processes), so everything it decides comes from the config alone: the block layout of
each worker's shard (and with it the fingerprint that names its disk directory, and
its Redis keys: by KV head where the engine allows, see `engine_shape`), the number of
CPU slots and disk blocks, the same on every worker of a tensor-parallel engine. Every
check that can fail runs in `__init__`, so a wrong key, an unsupported vLLM or an
unsupported engine shape stops the engine at start with one message.
"""

from __future__ import annotations

import contextvars
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.connector.cost_model import CostConfig, CostModel
from kvtier.connector.tier_config import TierConfig
from kvtier.connector.tier_stack import DiskBacking, StackConfig, build_tiers
from kvtier.offload.abstract import OffloadingManager as KvtierManager
from kvtier.store.diskformat import (
    block_file_bytes,
    delete_block_files,
    delete_block_files_except,
    directory_name,
)
from kvtier.store.shared_dir import list_whole, probe, shared_directory
from kvtier.types import BlockHash
from kvtier.vllm.log_setup import follow_vllm_logging
from kvtier.vllm.offloading.engine_shape import (
    check_disk_sharing,
    check_engine,
    check_head_major,
    head_sharing,
    layout_for,
    recovered_on_every_rank,
    shard_root,
)
from kvtier.vllm.offloading.extra_config import parse_extra_config
from kvtier.vllm.offloading.kvtier_manager import KvtierOffloadingManager
from kvtier.vllm.offloading.kvtier_worker import KvtierOffloadingWorker
from kvtier.vllm.offloading.shard_lookup import EveryShardLookup
from kvtier.vllm.version import check_vllm_version

# Set while KvtierConnector builds its spec: only that connector reports failed
# transfers to vLLM's recompute path (vLLM's own asserts that none fail).
UNDER_KVTIER_CONNECTOR: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvtier_under_kvtier_connector", default=False
)
# The model's KV heads (vLLM's total over all workers), set by KvtierConnector while it
# builds its spec: the spec sees only vLLM's offloading config, which does not name them,
# and the shared Redis tier keeps blocks by KV head (`engine_shape.head_sharing`).
TOTAL_KV_HEADS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "kvtier_total_kv_heads", default=None
)


class KvtierOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """kvtier's per-tier metrics (`kvtier.offload.tier_metrics`), for vLLM's `/metrics`."""
        from kvtier.vllm.offloading.tier_stats import metric_definitions

        return {**super().build_metric_definitions(extra_config), **metric_definitions()}

    def __init__(self, config: OffloadingConfig) -> None:
        check_vllm_version()
        follow_vllm_logging()
        super().__init__(config)
        self.kvtier: TierConfig = parse_extra_config(self.extra_config)
        self.report_failures = UNDER_KVTIER_CONNECTOR.get()
        check_engine(config, self.kvtier, self.report_failures)
        self.layout = layout_for(config)
        # None: Redis keeps this engine's blocks by rank, apart from other layouts
        by_head = self.kvtier.has_redis or self.kvtier.disk_shared
        self.sharing = head_sharing(config, TOTAL_KV_HEADS.get()) if by_head else None
        if self.kvtier.disk_shared:
            check_disk_sharing(config, self.sharing, TOTAL_KV_HEADS.get())
        self.block_size = config.groups[0].tokens_per_block
        self.stack_config = StackConfig.from_tier_config(
            self.kvtier,
            self.block_size,
            self.layout.bytes_per_block,
            enable_events=self.kv_events_config.enable_kv_cache_events,
        )
        self.num_cpu_slots = self.stack_config.cpu_blocks
        self.num_disk_blocks = self.stack_config.disk_blocks
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    # --- scheduler side ------------------------------------------------------

    def get_manager(self) -> KvtierOffloadingManager:
        if self._manager is None:
            self._manager = self._build_manager()
        return self._manager

    def _build_manager(self) -> KvtierOffloadingManager:
        """kvtier's one builder makes the tiers; a tensor-parallel engine whose Redis blocks
        are kept by rank (not by KV head) is the one exception, looked up under every
        worker's shard keys (`shard_lookup`)."""
        cfg, stack = self.kvtier, self.stack_config
        discards: list[BlockHash] = []
        backing = None
        sharing = self.sharing
        shared_disk = cfg.disk_shared and sharing is not None
        if cfg.disk_path is not None and shared_disk:
            assert sharing is not None  # (checked at start)
            directory = shared_directory(cfg.disk_path, sharing.shared)
            total, own = sharing.shard.total, sharing.shard.count
            found = partial(probe, directory, total=total, own=own)
            backing = DiskBacking(list_whole(directory, total), discards.extend, found)
        elif cfg.disk_path is not None:
            # the workers opened (and recovered) their directories before the scheduler
            whole, partial_shards = recovered_on_every_rank(cfg.disk_path, self.config)
            discards.extend(partial_shards)  # a shard some rank lacks is never loaded: deleted
            backing = DiskBacking(whole, discards.extend)
        # a shared directory's files are deleted by the workers that wrote them, only
        files_here = cfg.disk_path is not None and not shared_disk
        sharded = (
            stack.redis_url is not None and sharing is None and self.config.parallel.world_size > 1
        )
        tiers = build_tiers(
            replace(stack, redis_url=None) if sharded else stack,
            disk=backing,
            remote_key=self.layout if sharing is None else sharing.shared,
            remote_heads=None if sharing is None else sharing.shard.total,
            remote_group_heads=None if sharing is None else sharing.shard.count,
            async_lookup=True,
        )
        remote: KvtierManager | None = tiers.remote_manager
        close_remote = None
        if sharded:
            try:
                remote, close_remote = self._sharded_remote(stack.enable_events)
            except BaseException:
                tiers.close()
                raise

        def take_discards() -> list[BlockHash]:
            taken = list(discards)
            discards.clear()
            return taken

        def close() -> None:
            tiers.close()
            if close_remote is not None:
                close_remote()

        return KvtierOffloadingManager(
            tiers.local,
            remote,
            whole_keys=len(self.config.groups) > 1,
            enable_events=stack.enable_events,
            on_close=close,
            take_discards=take_discards,
            delete_files=self._delete_files if files_here else None,
            keep_files=self._keep_files if files_here else None,
            block_bytes=self.layout.bytes_per_block,
            file_bytes=block_file_bytes(self.layout.bytes_per_block),
            cost=CostModel(CostConfig(mode=cfg.load_decision), self.block_size),
            workers=self.config.parallel.world_size,
        )

    def _disk_directories(self) -> list[Path]:
        """Every worker's directory of this engine's shards."""
        disk_path = self.kvtier.disk_path or ""
        return [
            shard_root(disk_path, self.config, rank)
            / directory_name(layout_for(self.config, rank).fingerprint)
            for rank in range(self.config.parallel.world_size)
        ]

    def _delete_files(self, block_hashes: list[BlockHash]) -> None:
        if block_hashes:
            for directory in self._disk_directories():
                delete_block_files(directory, block_hashes)

    def _keep_files(self, block_hashes: set[BlockHash]) -> None:
        for directory in self._disk_directories():
            delete_block_files_except(directory, block_hashes)

    def _sharded_remote(self, events: bool) -> tuple[KvtierManager, Any]:
        """The Redis tier's manager of a multi-worker engine on the scheduler side: a
        block is there only if every worker's shard is (see `shard_lookup`)."""
        tiers: list[Any] = []

        def close() -> None:
            for tier in tiers:
                tier.close()

        try:  # a rank that fails to open (a wrong password) closes the ranks opened
            for rank in range(self.config.parallel.world_size):
                tiers.append(self._open_remote(rank))
        except BaseException:
            close()
            raise
        first = tiers[0].manager(enable_events=events, async_lookup=True)
        others = [tier.manager(async_lookup=True) for tier in tiers[1:]]

        return EveryShardLookup(first, others), close

    def _open_remote(self, rank: int | None = None) -> Any:
        """The Redis tier under the keys of one worker's shards (default this one's)."""
        cfg = self.kvtier
        if cfg.redis_url is None:
            return None
        from kvtier.remote.tier import RemoteTier

        if self.sharing is not None:  # every worker's heads under the same keys
            return RemoteTier.from_url(
                cfg.redis_url,
                self.sharing.shared,
                block_size=self.block_size,
                heads=self.sharing.shard.total,
                group_heads=self.sharing.shard.count,
                **cfg.redis_options(),
            )
        return RemoteTier.from_url(
            cfg.redis_url,
            self.layout if rank is None else layout_for(self.config, rank),
            block_size=self.block_size,
            **cfg.redis_options(),
        )

    # --- worker side -----------------------------------------------------------

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KvtierOffloadingWorker:
        if self._worker is None:
            if self.sharing is not None:
                check_head_major(kv_caches, self.sharing, self.config.parallel.world_size)
            disk_path = self.kvtier.disk_path
            self._worker = KvtierOffloadingWorker(
                self.kvtier,
                self.layout,
                kv_caches,
                disk_root=None
                if disk_path is None or self.kvtier.disk_shared
                else shard_root(disk_path, self.config),
                disk_sharing=self.sharing if self.kvtier.disk_shared else None,
                num_cpu_slots=self.num_cpu_slots,
                num_disk_blocks=self.num_disk_blocks,
                remote=self._open_remote(),
                remote_sharing=self.sharing,
                report_failures=self.report_failures,
            )
        return self._worker


__all__ = ["KvtierOffloadingSpec", "layout_for"]
