"""vLLM OpenAI servers as kvtier's router expects them, for the router's engine test and
its benchmark.

The servers hash with `sha256_cbor` (what the router reproduces), publish KV events on
`ipc://` endpoints they bind (the router connects; no port to race for) with a replay
buffer, and run kvtier's CPU tier (four times the pool). They run with vLLM's own CPU
binding and warnings-only logs: no side is compared with another here, and the router's
runs read their logs only when a start fails.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.router import EngineSpec
from kvtier.vllm.engines.model import ModelShape
from kvtier.vllm.engines.openai_server import OpenAIServer, ServerConfig
from kvtier.vllm.offloading.extra_config import transfer_config

BLOCK = 32
POOL_BLOCKS = 128  # each server's pool (num_gpu_blocks_override)
TOPIC = "kv"
SERVED_NAME = "tiny"
# Each answer's length (ignore_eos) in the conversations the test and the benchmark
# play: short, since what the router routes on is the prompts.
MAX_TOKENS = 8


def router_configs(
    model: Path, shape: ModelShape, workdir: Path, n: int = 2, pool_blocks: int = POOL_BLOCKS
) -> dict[str, ServerConfig]:
    """`n` servers' configs, by engine name (`e0`, `e1`, ...), their event endpoints
    under `workdir`."""
    kv_transfer = transfer_config(cpu_bytes_to_use=4 * pool_blocks * shape.kv_bytes(BLOCK))
    configs: dict[str, ServerConfig] = {}
    for i in range(n):
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"ipc://{workdir}/e{i}.events",
            "replay_endpoint": f"ipc://{workdir}/e{i}.replay",
            "topic": TOPIC,
        }
        configs[f"e{i}"] = ServerConfig(
            model,
            BLOCK,
            pool_blocks=pool_blocks,
            max_num_seqs=4,
            kv_transfer_config=kv_transfer,
            kv_events_config=kv_events,
            served_name=SERVED_NAME,
            extra_args=("--prefix-caching-hash-algo", "sha256_cbor", "--disable-log-stats"),
            env={"VLLM_LOGGING_LEVEL": "WARNING"},
            same_cpus=False,
        )
    return configs


def engine_spec(server: OpenAIServer) -> EngineSpec:
    """What the router needs of a server `router_configs` configured."""
    events = server.config.kv_events_config or {}
    return EngineSpec(
        server.url,
        events.get("endpoint"),
        events.get("replay_endpoint"),
        topic=TOPIC,
        name=server.name,
    )
