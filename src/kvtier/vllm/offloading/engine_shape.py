"""What an engine's shape (parallelism, KV-cache groups) means for kvtier's blocks.

Each worker of a tensor-parallel engine holds its own shard of every block (its KV
heads), and moves it to and from its own tiers: the bytes of one rank's shard are
meaningless to another rank, to an engine of another parallel layout, and to another
group layout. So the layout a worker stores under names all of that (`identity`),
and its fingerprint namespaces the rank's disk directory and Redis keys: a
one-worker engine and a two-worker engine never read each other's blocks; two
engines of the same layout share them.

Hybrid models: vLLM makes one KV-cache group per set of layers of one attention kind
(full, sliding window) and lays the i-th layer of every group over one shared tensor,
so a block id names the same rows of the same tensors whatever its group. One block
of any group is thus the engine's tensors' rows for that id, and the only thing the
group changes is the block's key: vLLM's offload keys, a block hash and the group's
index. Which blocks of a sliding-window group to store and load (the window's) is
decided by vLLM's scheduler.

Mamba (state-space) groups have a state per request rather than per block, and a
block size of their own: refused at start (see `check_engine` and KvtierConnector).

The shared Redis tier is the exception to "one rank's shard": where vLLM's KV cache is
head-major (its `LBHNC` layout: a layer's page is its KV heads one after the other, each
head's tokens with their K and V) and the heads divide among the workers, Redis keeps a
block by KV head (`kvtier.remote.head_keys`), named by what the bytes are (model, dtype,
block size, KV-cache groups, KV heads, the page layout) and not by who wrote them
(`head_sharing`): an engine of any tensor-parallel size reads every other's blocks, each
worker exactly its heads. Any other engine keeps its own keys by rank, as the disk tier
always does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.connector.tier_config import TierConfig
from kvtier.remote.head_shard import HeadShard
from kvtier.store.diskdir import list_blocks
from kvtier.store.layout import KVLayout
from kvtier.types import BlockHash


def identity(config: OffloadingConfig, rank: int) -> dict[str, Any]:
    """Everything that makes two engines' shards interchangeable (JSON-safe): the
    fields vLLM's own file-system tier names its directories with, and the rank."""
    parallel = config.parallel
    return {
        "model": config.model.name,
        "dtype": config.model.dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "tp": parallel.tp_size,
        "pp": parallel.pp_size,
        "pcp": parallel.pcp_size,
        "dcp": parallel.dcp_size,
        "world_size": parallel.world_size,
        "rank": rank,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
    }


def layout_for(config: OffloadingConfig, rank: int | None = None) -> KVLayout:
    """The block layout of one worker's shard (`rank`, default this config's), derived
    from vLLM's config alone so that the scheduler and the workers agree on it.

    Only bytes matter to the data plane, so the geometry is stated in bytes (one
    "head" of `segment_bytes / tokens` bytes), one "layer" per KV tensor the engine
    has (the most layers of any group: the groups' layers share those tensors).
    """
    rank = config.parallel.rank if rank is None else rank
    num_layers = max(len(group.layer_names) for group in config.groups)
    tokens = config.groups[0].tokens_per_block
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
        model_id="vllm:" + json.dumps(identity(config, rank), sort_keys=True),
    )


# vLLM's KV cache layout (`KVCacheLayout`) whose page of a layer is [KV head][token][K, V]
HEAD_MAJOR_LAYOUT = "LBHNC"


@dataclass(frozen=True)
class HeadSharing:
    """How one worker of an engine keeps its blocks in Redis by KV head."""

    shared: KVLayout  # one KV head of a block, every layer: names the keys of all engines
    shard: HeadShard  # this worker's heads
    row: KVLayout  # this worker's heads of a block, one after the other


def shared_identity(config: OffloadingConfig, total_kv_heads: int) -> dict[str, Any]:
    """What makes one KV head of a block the same bytes in two engines (JSON-safe): the
    fields of `identity` but the parallel layout, and the model's KV heads and page layout."""
    return {
        "model": config.model.name,
        "dtype": config.model.dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "kv_cache_layout": config.kv_cache_layout,
        "kv_heads": total_kv_heads,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
    }


def head_sharing(
    config: OffloadingConfig, total_kv_heads: int | None, rank: int | None = None
) -> HeadSharing | None:
    """Worker `rank`'s (default this config's) part of the blocks kept by KV head, or None
    where they are kept by rank: the model's KV heads unknown (the spec built outside
    KvtierConnector), a page that is not head-major, or heads that do not divide among
    the workers (see `HeadShard.of_rank`)."""
    if total_kv_heads is None or config.kv_cache_layout != HEAD_MAJOR_LAYOUT:
        return None
    parallel = config.parallel
    rank = parallel.rank if rank is None else rank
    try:
        shard = HeadShard.of_rank(total_kv_heads, parallel.tp_size, rank % parallel.tp_size)
    except ValueError:
        return None
    num_layers = max(len(group.layer_names) for group in config.groups)
    tokens = config.groups[0].tokens_per_block
    per_block = config.worker_kv_bytes_per_block
    if per_block % (shard.count * num_layers * 2 * tokens):
        return None  # not whole tokens of whole heads: not the layout named
    head_size = per_block // (shard.count * num_layers * 2 * tokens)
    model_id = "vllm-heads:" + json.dumps(shared_identity(config, total_kv_heads), sort_keys=True)
    shared = KVLayout(num_layers, 1, head_size, tokens, dtype="uint8", model_id=model_id)
    row = KVLayout(
        num_layers * shard.count,
        1,
        head_size,
        tokens,
        dtype="uint8",
        model_id=f"{model_id}#heads{shard.first}+{shard.count}",
    )
    return HeadSharing(shared, shard, row)


def check_disk_sharing(
    config: OffloadingConfig, sharing: HeadSharing | None, total_kv_heads: int | None
) -> None:
    """Refuse `disk_shared` for an engine whose blocks cannot be kept by KV head (a
    shared directory would otherwise mix layouts), naming why."""
    if sharing is not None:
        return
    parallel = config.parallel
    raise ValueError(
        f"kv_connector_extra_config['disk_shared'] is true, but this engine's blocks "
        f"cannot be kept by KV head: that needs vLLM's {HEAD_MAJOR_LAYOUT} KV cache layout "
        f"(this engine's: {config.kv_cache_layout!r}), the model's KV heads (known under "
        f"KvtierConnector: {total_kv_heads}) dividing among the {parallel.tp_size} "
        f"tensor-parallel workers (or the workers among them), and whole heads per worker; "
        f"set disk_shared to false (a directory per rank, shared by nothing)"
    )


def check_head_major(kv_caches: CanonicalKVCaches, sharing: HeadSharing, workers: int) -> None:
    """Refuse, at start, caches whose pages are not what `head_sharing` cuts: vLLM's own
    map of each page into the parallelism-free page (all heads) must put the page whole
    at its heads' place. (One worker's page is that page: no map needed.)"""
    shard = sharing.shard
    for refs in kv_caches.group_data_refs:
        for ref in refs:
            mapping = ref.mapping
            if mapping is None and workers == 1:
                continue
            page = ref.page_size_bytes
            runs = (
                None
                if mapping is None
                else [
                    (r.local_offset, r.canonical_offset, r.fragment_size, r.num_fragments)
                    for r in mapping.runs
                ]
            )
            place = shard.first // shard.count * page
            whole = shard.total // shard.count * page
            if (
                mapping is None
                or runs != [(0, place, page, 1)]
                or (mapping.canonical_page_size_bytes != whole)
            ):
                raise ValueError(
                    f"kvtier keeps Redis blocks by KV head for vLLM's {HEAD_MAJOR_LAYOUT} KV "
                    f"cache layout, but vLLM maps this worker's {page}-byte page (heads "
                    f"{shard.first}..{shard.first + shard.count - 1} of {shard.total}) as "
                    f"{runs} into a page of "
                    f"{None if mapping is None else mapping.canonical_page_size_bytes} bytes, "
                    f"not whole at byte {place} of {whole}"
                )


def shard_root(disk_path: str, config: OffloadingConfig, rank: int | None = None) -> Path:
    """The disk root of one rank's shards: `disk_path` for a one-worker engine, a
    directory per rank below it otherwise (each rank's DiskStore owns its root)."""
    parallel = config.parallel
    if parallel.world_size == 1:
        return Path(disk_path)
    rank = parallel.rank if rank is None else rank
    return Path(disk_path) / f"rank{rank}-of-{parallel.world_size}"


def check_engine(config: OffloadingConfig, cfg: TierConfig, kvtier_connector: bool) -> None:
    """Refuse engine shapes the spec does not serve, naming the setting to change."""
    if config.cache.blocks_per_chunk != 1:
        raise ValueError(
            f"KvtierOffloadingSpec offloads whole engine blocks: drop 'block_size' / "
            f"'blocks_per_chunk' from kv_connector_extra_config (blocks_per_chunk is "
            f"{config.cache.blocks_per_chunk})"
        )
    sizes = sorted({group.tokens_per_block for group in config.groups})
    if len(sizes) != 1:
        raise ValueError(
            f"KvtierOffloadingSpec needs one block size for every KV-cache group; this "
            f"engine's groups have {sizes} tokens per block (a state-space/Mamba group "
            f"or a mixed-size hybrid model is not supported)"
        )
    parallel = config.parallel
    if parallel.pp_size != 1:
        raise ValueError(
            f"KvtierOffloadingSpec does not run under pipeline parallelism "
            f"(pipeline_parallel_size is {parallel.pp_size}): stages hold different "
            f"layers, and the scheduler side sees only the first stage's (vLLM 0.32's CPU "
            f"build fails a pipeline-parallel engine's first request even without a "
            f"connector, so this was never run); use tensor parallelism"
        )
    if parallel.pcp_size != 1 or parallel.dcp_size != 1:
        raise ValueError(
            f"KvtierOffloadingSpec does not run under context parallelism "
            f"(prefill {parallel.pcp_size}, decode {parallel.dcp_size}): a worker's shard "
            f"would be part of a block's tokens, not of its heads; use tensor parallelism"
        )
    if not kvtier_connector and (cfg.has_disk or cfg.has_redis or cfg.cpu_checksums):
        raise ValueError(
            'disk_path, redis_url and cpu_checksums need "kv_connector": "KvtierConnector" '
            'with "kv_connector_module_path": "kvtier.vllm": vLLM\'s own OffloadingConnector '
            "asserts that every transfer succeeds, so a failed disk or Redis load would stop "
            "the engine instead of being recomputed"
        )


def recovered_on_every_rank(
    disk_path: str, config: OffloadingConfig
) -> tuple[list[BlockHash], list[BlockHash]]:
    """The blocks whose shard every rank recovered (rank 0's order: oldest first), and
    the shards of blocks some rank lacks (to delete: no rank will ever load them)."""
    listings = [
        list_blocks(shard_root(disk_path, config, rank), layout_for(config, rank))
        for rank in range(config.parallel.world_size)
    ]
    whole = set(listings[0]).intersection(*listings[1:])
    partial = sorted(set().union(*listings) - whole)
    return [h for h in listings[0] if h in whole], partial
