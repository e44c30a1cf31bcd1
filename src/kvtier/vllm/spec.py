"""`KvtierOffloadingSpec`: what vLLM's offloading connector loads from kvtier.

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
      "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier.vllm", "cpu_bytes_to_use": 8000000000}}'

The spec is built twice per engine (once for the scheduler, once per worker, maybe
in different processes), so everything it decides comes from the config alone: the
block layout (and with it the fingerprint that names disk directories and Redis
keys), the number of CPU slots and disk blocks. Every check that can fail runs in
`__init__`, so a wrong key, an unsupported vLLM or an unsupported engine shape stops
the engine at start with one message.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.connector.tier_config import TierConfig
from kvtier.connector.tier_stack import DiskBacking, StackConfig, build_tiers
from kvtier.store.diskdir import list_blocks
from kvtier.store.diskformat import (
    block_file_bytes,
    delete_block_files,
    delete_block_files_except,
    directory_name,
)
from kvtier.store.layout import KVLayout
from kvtier.types import BlockHash
from kvtier.vllm.extra_config import parse_extra_config
from kvtier.vllm.kvtier_manager import KvtierOffloadingManager
from kvtier.vllm.kvtier_worker import KvtierOffloadingWorker
from kvtier.vllm.version import check_vllm_version

if TYPE_CHECKING:
    from kvtier.remote.tier import RemoteTier

# Set while KvtierConnector builds its spec: only that connector reports failed
# transfers to vLLM's recompute path (vLLM's own asserts that none fail).
UNDER_KVTIER_CONNECTOR: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvtier_under_kvtier_connector", default=False
)


def layout_for(config: OffloadingConfig) -> KVLayout:
    """The block layout both sides derive from vLLM's config alone.

    Only bytes matter to the data plane, so the geometry is stated in bytes (one
    "head" of `segment_bytes / tokens` bytes); what makes blocks interchangeable, the
    model, its KV dtype and the block size, goes into the fingerprint via `model_id`.
    """
    (group,) = config.groups
    num_layers = len(group.layer_names)
    tokens = group.tokens_per_block
    per_block = config.worker_kv_bytes_per_block
    if num_layers < 1 or per_block % (2 * num_layers * tokens):
        raise ValueError(
            f"cannot cut {per_block} KV bytes per block into K and V planes of "
            f"{num_layers} layers x {tokens} tokens"
        )
    return KVLayout(
        num_layers=num_layers,
        num_kv_heads=1,
        head_size=per_block // (2 * num_layers * tokens),
        block_size=tokens,
        dtype="uint8",
        model_id=f"vllm:{config.model.name}:{config.model.dtype}",
    )


class KvtierOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """kvtier's per-tier metrics (`kvtier.offload.tier_metrics`), for vLLM's `/metrics`."""
        from kvtier.vllm.tier_stats import metric_definitions

        return {**super().build_metric_definitions(extra_config), **metric_definitions()}

    def __init__(self, config: OffloadingConfig) -> None:
        check_vllm_version()
        super().__init__(config)
        self.kvtier: TierConfig = parse_extra_config(self.extra_config)
        self.report_failures = UNDER_KVTIER_CONNECTOR.get()
        _check_engine(config, self.kvtier, self.report_failures)
        self.layout = layout_for(config)
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
        cfg = self.kvtier
        discards: list[BlockHash] = []
        backing = None
        if cfg.disk_path is not None:
            # the worker opened (and recovered) the directory before the scheduler is built
            backing = DiskBacking(list_blocks(cfg.disk_path, self.layout), discards.extend)
        tiers = build_tiers(
            self.stack_config,
            disk=backing,
            remote_key=self.layout,
            async_lookup=True,
        )

        def take_discards() -> list[BlockHash]:
            taken = list(discards)
            discards.clear()
            return taken

        return KvtierOffloadingManager(
            tiers.local,
            tiers.remote_manager,
            enable_events=self.stack_config.enable_events,
            on_close=tiers.close,
            take_discards=take_discards,
            delete_files=self._delete_files if cfg.disk_path is not None else None,
            keep_files=self._keep_files if cfg.disk_path is not None else None,
            block_bytes=self.layout.bytes_per_block,
            file_bytes=block_file_bytes(self.layout.bytes_per_block),
        )

    def _disk_directory(self) -> Path:
        return Path(self.kvtier.disk_path or "") / directory_name(self.layout.fingerprint)

    def _delete_files(self, block_hashes: list[BlockHash]) -> None:
        if block_hashes:
            delete_block_files(self._disk_directory(), block_hashes)

    def _keep_files(self, block_hashes: set[BlockHash]) -> None:
        delete_block_files_except(self._disk_directory(), block_hashes)

    def _open_remote(self) -> RemoteTier | None:
        """The worker's own connection to the Redis tier (its data plane)."""
        cfg = self.kvtier
        if cfg.redis_url is None:
            return None
        from kvtier.remote.tier import RemoteTier

        return RemoteTier.from_url(
            cfg.redis_url, self.layout, block_size=self.block_size, **cfg.redis_options()
        )

    # --- worker side -----------------------------------------------------------

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KvtierOffloadingWorker:
        if self._worker is None:
            self._worker = KvtierOffloadingWorker(
                self.kvtier,
                self.layout,
                kv_caches,
                num_cpu_slots=self.num_cpu_slots,
                num_disk_blocks=self.num_disk_blocks,
                remote=self._open_remote(),
                report_failures=self.report_failures,
            )
        return self._worker


def _check_engine(config: OffloadingConfig, cfg: TierConfig, kvtier_connector: bool) -> None:
    """Refuse engine shapes the spec does not serve, naming the setting to change."""
    if len(config.groups) != 1:
        raise ValueError(
            f"KvtierOffloadingSpec serves models with one KV-cache group; this engine has "
            f"{len(config.groups)} (hybrid or sliding-window models are not supported yet)"
        )
    if config.cache.blocks_per_chunk != 1:
        raise ValueError(
            f"KvtierOffloadingSpec offloads whole engine blocks: drop 'block_size' / "
            f"'blocks_per_chunk' from kv_connector_extra_config (blocks_per_chunk is "
            f"{config.cache.blocks_per_chunk})"
        )
    if config.parallel.world_size != 1:
        raise ValueError(
            f"KvtierOffloadingSpec runs on one worker; this engine has "
            f"{config.parallel.world_size} (tensor/pipeline parallelism is not supported yet)"
        )
    if not kvtier_connector and (cfg.has_disk or cfg.has_redis or cfg.cpu_checksums):
        raise ValueError(
            'disk_path, redis_url and cpu_checksums need "kv_connector": "KvtierConnector" '
            'with "kv_connector_module_path": "kvtier.vllm": vLLM\'s own OffloadingConnector '
            "asserts that every transfer succeeds, so a failed disk or Redis load would stop "
            "the engine instead of being recomputed"
        )
