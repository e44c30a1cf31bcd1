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
import os
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.offload import CPUOffloadingManager, FilterReusedOffloadingManager
from kvtier.offload.abstract import OffloadingManager as KvtierManager
from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.offload.disk_manager import DiskOffloadingManager
from kvtier.store.diskformat import (
    DIR_PREFIX,
    BlockHeader,
    delete_block_files,
    delete_block_files_except,
    hash_of,
)
from kvtier.store.layout import KVLayout
from kvtier.types import BlockHash
from kvtier.vllm.extra_config import KvtierVllmConfig, parse_extra_config
from kvtier.vllm.kvtier_manager import KvtierOffloadingManager
from kvtier.vllm.kvtier_worker import KvtierOffloadingWorker
from kvtier.vllm.version import check_vllm_version

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
        self.kvtier: KvtierVllmConfig = parse_extra_config(self.extra_config)
        self.report_failures = UNDER_KVTIER_CONNECTOR.get()
        _check_engine(config, self.kvtier, self.report_failures)
        self.layout = layout_for(config)
        self.block_size = config.groups[0].tokens_per_block
        self.num_cpu_slots = self.kvtier.cpu_bytes_to_use // self.layout.bytes_per_block
        if self.num_cpu_slots < 1:
            raise ValueError(
                f"cpu_bytes_to_use {self.kvtier.cpu_bytes_to_use} is below one block of "
                f"this model ({self.layout.bytes_per_block} bytes)"
            )
        file_bytes = BlockHeader.size_for(32) + self.layout.bytes_per_block
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
            discards.extend(disk.adopt(recovered_blocks(cfg.disk_path, self.layout)))
            lower: KvtierManager = disk
            if cfg.store_threshold >= 2:  # admission to the disk, as the replay does
                lower = FilterReusedOffloadingManager(disk, store_threshold=cfg.store_threshold)
            local = CascadeOffloadingManager(
                cpu, lower, disk_writes=cfg.disk_writes, enable_events=events
            )
        elif cfg.store_threshold >= 2:
            local = FilterReusedOffloadingManager(cpu, store_threshold=cfg.store_threshold)
        remote, tier = None, self._open_remote()
        if tier is not None:
            remote = tier.manager(enable_events=events, async_lookup=True)

        def take_discards() -> list[BlockHash]:
            taken = list(discards)
            discards.clear()
            return taken

        return KvtierOffloadingManager(
            local,
            remote,
            enable_events=events,
            on_close=tier.close if tier is not None else None,
            take_discards=take_discards,
            delete_files=self._delete_files if cfg.disk_path is not None else None,
            keep_files=self._keep_files if cfg.disk_path is not None else None,
            block_bytes=self.layout.bytes_per_block,
            file_bytes=BlockHeader.size_for(32) + self.layout.bytes_per_block,
        )

    def _disk_directory(self) -> Path:
        return Path(self.kvtier.disk_path or "") / f"{DIR_PREFIX}{self.layout.fingerprint}"

    def _delete_files(self, block_hashes: list[BlockHash]) -> None:
        if block_hashes:
            delete_block_files(self._disk_directory(), block_hashes)

    def _keep_files(self, block_hashes: set[BlockHash]) -> None:
        delete_block_files_except(self._disk_directory(), block_hashes)

    def _open_remote(self) -> Any:
        cfg = self.kvtier
        if cfg.redis_url is None:
            return None
        from kvtier.remote.tier import RemoteTier

        return RemoteTier.from_url(
            cfg.redis_url,
            self.layout,
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
                num_cpu_slots=self.num_cpu_slots,
                num_disk_blocks=self.num_disk_blocks,
                remote=self._open_remote(),
                report_failures=self.report_failures,
            )
        return self._worker


def _check_engine(config: OffloadingConfig, cfg: KvtierVllmConfig, kvtier_connector: bool) -> None:
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


def recovered_blocks(disk_path: str, layout: KVLayout) -> list[BlockHash]:
    """Block files of `layout` under `disk_path`, oldest first, as the worker's recovery
    left them (the worker opens the directory, and recovers it, before the scheduler
    is built). Read only: the scheduler side never deletes behind the worker."""
    directory = Path(disk_path) / f"{DIR_PREFIX}{layout.fingerprint}"
    size = BlockHeader.size_for(32) + layout.bytes_per_block
    found: list[tuple[int, BlockHash]] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        block_hash = hash_of(entry.name)
        if block_hash is not None and entry.is_file() and entry.stat().st_size == size:
            found.append((entry.stat().st_mtime_ns, block_hash))
    return [h for _, h in sorted(found)]
