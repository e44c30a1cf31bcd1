"""`kvtier replay --vllm-config`: replay the tiers an engine's extra config describes.

A user who runs vLLM with kvtier has one `kv_connector_extra_config`; asking the replay
what those tiers would do on a trace must not mean translating it by hand into replay
flags (and getting a budget or a default wrong). The dict is parsed by the engine's own
parser, and its byte budgets become blocks with the model's KV bytes per block, so
the replay builds the stack the engine builds.

The replay never opens the config's `disk_path` (it counts blocks without files: a
replay must not touch a production directory) and keeps its own Redis key namespace
(a replay's blocks never mix with an engine's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.cli.replay import store_queues_from_args
from kvtier.sim.replay_config import ReplayConfig, TimeModel
from kvtier.store.layout import KVLayout
from kvtier.vllm.offloading.extra_config import parse_extra_config

# Replay flags that set what the extra config sets: refused beside it, so no figure
# comes from a mix of the two.
STACK_FLAGS = (
    "--policy",
    "--cpu-blocks",
    "--cpu-frac",
    "--store-threshold",
    "--disk-blocks",
    "--disk-writes",
    "--redis",
)


def read_json_argument(flag: str, text: str) -> dict[str, Any]:
    """A JSON object given inline or as `@file`."""
    if text.startswith("@"):
        return read_json_file(flag, Path(text[1:]))
    return _json_object(flag, "inline", text)


def read_json_file(flag: str, path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    return _json_object(flag, str(path), text)


def _json_object(flag: str, source: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} ({source}): not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} ({source}): expected a JSON object, got {type(value).__name__}")
    return value


def kv_bytes_per_block(args: argparse.Namespace, block_size: int) -> int:
    """One block's KV bytes: given, or derived from the model's config.json."""
    if (args.kv_bytes_per_block is None) == (args.model_config is None):
        raise ValueError(
            "--vllm-config needs the model's KV size: give --kv-bytes-per-block N (bytes of K "
            "and V of one block over all layers) or --model-config config.json (not both)"
        )
    if args.kv_bytes_per_block is not None:
        bytes_per_block: int = args.kv_bytes_per_block
        return bytes_per_block
    model = read_json_file("--model-config", Path(args.model_config))
    return KVLayout.from_model_config(model, block_size).bytes_per_block


def replay_config(args: argparse.Namespace, block_size: int) -> ReplayConfig:
    """The replay of `args.vllm_config`'s tiers behind a pool of `--gpu-blocks` blocks."""
    given: set[str] = getattr(args, "given", set())
    clash = [flag for flag in STACK_FLAGS if flag in given]
    if clash:
        raise ValueError(
            f"{' and '.join(clash)}: --vllm-config sets the tiers; drop the flag or the key"
        )
    if not args.gpu_blocks:
        raise ValueError(
            "--vllm-config replays an engine: give its pool with --gpu-blocks N (vLLM logs "
            "'GPU KV cache size: T tokens' at start; N = T / block size)"
        )
    tiers = parse_extra_config(read_json_argument("--vllm-config", args.vllm_config))
    bytes_per_block = kv_bytes_per_block(args, block_size)
    return ReplayConfig(
        policy=tiers.eviction_policy,
        cpu_blocks=tiers.cpu_blocks(bytes_per_block),
        gpu_blocks=args.gpu_blocks,
        store_threshold=tiers.store_threshold,
        time_model=TimeModel() if args.concurrent else None,
        store_on=args.store_on,
        disk_blocks=tiers.disk_blocks(bytes_per_block),
        disk_writes=tiers.disk_writes,
        data=args.data,
        redis_url=tiers.redis_url,
        redis_namespace=args.redis_namespace,
        redis_options=tiers.redis_options() if tiers.has_redis else {},
        store_queues=store_queues_from_args(
            args,
            local_blocks=max(1, tiers.store_queue_bytes(True) // bytes_per_block),
            remote_blocks=max(1, tiers.store_queue_bytes(False) // bytes_per_block),
        ),
    )
