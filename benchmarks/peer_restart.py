"""bench_peers' restart row: a returning 4,096-token prompt on the 0.5B-shaped model, from
each side's CPU store and from its local disk after a restart, against recompute.

One side at a time (a 0.5B engine each), the same model, flags and CPU binding:

- `vllm`: the prompt cold (recompute), and again once the pool forgot it (recompute);
- `kvtier`: CPU tier and disk tier (`disk_path`, `write_through`): the prompt cold, then
  after a pool-only reset (`POST /reset_prefix_cache`: the engine's pool forgets, the
  tiers keep) from the CPU tier; then the server is stopped and started again on the
  same disk directory, and the prompt comes from disk;
- `lmcache`: L1 in CPU memory and its `fs` L2 adapter on local disk (LMCache's local
  disk storage in its multiprocess mode): the same steps, its server restarted with the
  engine (so L1 is empty and only the disk holds the prompt).

Each figure is one request's time to its single output token (`max_tokens` 1), with the
tokens vLLM took from its pool and from the connector (`/metrics`), so a load that
silently recomputed shows. The returns repeat, so that each side's spread is known: the
CPU return `returns` times in the first server's life (the pool forgets before each), the
disk return once in each of `restarts` further lives, kvtier's and LMCache's restarts
taking turns (the side going first alternating). `restart_verdicts` compares the medians.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.peer_figures import VLLM_COUNTERS, counters, delta, restart_verdicts
from benchmarks.peer_sides import GIB, LMCacheServer, LMCacheSettings, lmcache_transfer_config
from kvtier.vllm import transfer_config
from kvtier.vllm.engines import QWEN2_05B, write_model
from kvtier.vllm.engines.openai_server import OpenAIServer, ServerConfig, running_servers
from kvtier.vllm.engines.tokenizer import write_tokenizer

BLOCK = 32
SETTLE_S = 5.0  # before a timed return: the stores' asynchronous writes finish first


def _timed(server: OpenAIServer, prompt: list[int]) -> dict[str, float]:
    """One request for one token: its seconds and the engine's counters over it."""
    before = counters(server.get("/metrics"), VLLM_COUNTERS)
    body = {"model": "model", "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    request = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()
    seconds = time.perf_counter() - started
    time.sleep(1.5)  # vLLM's stats reach /metrics a logging interval late
    after = counters(server.get("/metrics"), VLLM_COUNTERS)
    got = delta(before, after)
    return {"s": seconds, "pool_tokens": got["pool_hits"], "connector_tokens": got["external_hits"]}


def _forget_pool(server: OpenAIServer) -> None:
    answer = server.post("/reset_prefix_cache")  # the pool only: the connector keeps its blocks
    if answer != {"success": True}:
        raise RuntimeError(f"{server.url}: reset_prefix_cache answered {answer!r}")


Steps = dict[str, list[dict[str, float]]]  # a step's name -> its returns, in order


def _session(config: ServerConfig, workdir: Path, name: str, steps: list[str],
             prompt: list[int], warm: list[int]) -> Steps:  # fmt: skip
    """One server's life: warm-up, then each step ('cold', 'pool forgot', 'restarted')."""
    out: Steps = {}
    with running_servers({name: config}, workdir) as servers:
        server = servers[name]
        _timed(server, warm)
        for step in steps:
            if step == "pool forgot":
                time.sleep(SETTLE_S)
                _forget_pool(server)
            out.setdefault(step, []).append(_timed(server, prompt))
            print(f"  restart row {name} {step}: {out[step][-1]}", flush=True)
        time.sleep(SETTLE_S)  # the last stores reach the disk before the server stops
    return out


def _add(into: Steps, steps: Steps) -> None:
    for step, returns in steps.items():
        into.setdefault(step, []).extend(returns)


def restart_row(
    workdir: Path, peers_bin: Path, tokens: int = 4096, returns: int = 3, restarts: int = 3
) -> dict[str, Any]:
    model = write_model(workdir / "model-05b", QWEN2_05B, weights=False)
    write_tokenizer(model, QWEN2_05B.vocab)
    rng = random.Random(34)
    prompt = [rng.randrange(10, QWEN2_05B.vocab) for _ in range(tokens)]
    warm = [rng.randrange(10, QWEN2_05B.vocab) for _ in range(2 * BLOCK)]
    pool = tokens // BLOCK + 32
    alone = ServerConfig(model, BLOCK, pool_blocks=pool, max_model_len=tokens + BLOCK)
    cpu_bytes = GIB
    out: dict[str, Any] = {"tokens": tokens, "cpu_bytes": cpu_bytes, "disk_bytes": 4 * GIB}
    out["vllm"] = _session(alone, workdir, "restart-vllm", ["cold", "pool forgot"], prompt, warm)
    disk = workdir / "kvtier-disk"
    kvtier = replace(alone, kv_transfer_config=transfer_config(
        cpu_bytes_to_use=cpu_bytes, disk_path=str(disk), disk_bytes_to_use=4 * GIB))  # fmt: skip
    l2 = json.dumps({"type": "fs", "base_path": str(workdir / "lmcache-disk")})
    settings = LMCacheSettings(chunk_size=BLOCK, l1_bytes=cpu_bytes)

    def kvtier_life(life: int, steps: list[str]) -> Steps:
        return _session(kvtier, workdir, f"restart-kvtier-{life}", steps, prompt, warm)

    def lmcache_life(life: int, steps: list[str]) -> Steps:
        log = workdir / f"restart-lmcache-server-{life}.log"
        with LMCacheServer(peers_bin, settings, log, extra_args=("--l2-adapter", l2)) as server:
            server.wait_ready()
            config = replace(alone, kv_transfer_config=lmcache_transfer_config(server.port),
                             env={"LMCACHE_MP_TRANSFER_MODE": "engine_driven"},
                             python=str(peers_bin / "python"))  # fmt: skip
            return _session(config, workdir, f"restart-lmcache-{life}", steps, prompt, warm)

    lives = {"kvtier": kvtier_life, "lmcache": lmcache_life}
    first = ["cold"] + ["pool forgot"] * returns
    for side, life in lives.items():
        out[side] = life(0, first)
    for r in range(restarts):
        for side in list(lives) if r % 2 == 0 else list(lives)[::-1]:
            _add(out[side], lives[side](r + 1, ["restarted"]))
    out["verdicts"] = restart_verdicts(out)
    return out
