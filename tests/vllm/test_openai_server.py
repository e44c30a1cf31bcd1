"""kvtier behind vLLM's OpenAI server, driven over HTTP as a user drives it.

Two server starts for every check (each costs about a minute here):

1. the README's `--kv-transfer-config` with a CPU tier of 8 blocks, a disk tier and a
   Redis server, KV events over ZMQ, `--enable-prompt-tokens-details`. The engine
   tests' overflow workload as streaming completions (the OpenAI client): the
   returning prompt reports all its cacheable tokens cached (served by kvtier, its
   CPU tier having evicted it), `/metrics` shows kvtier's per-tier figures,
   the events show disk and Redis stores with their medium. Then a reset
   (`POST /reset_prefix_cache?reset_external=true`, the dev endpoint of
   `reset_prefix_cache(reset_connector=True)`): the prompt is recomputed. SIGTERM.
2. the same `disk_path`, no Redis: the prompt recomputed after the reset (in the CPU
   tier at the SIGTERM, and on disk: `disk_writes` is `write_through` by default)
   comes back whole from disk; a prompt of before the reset does not.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.vllm.engines import TINY
from kvtier.vllm.engines.openai_server import OpenAIServer, ServerConfig, start_servers
from kvtier.vllm.engines.tokenizer import chat_model, text_of
from tests.remote.conftest import serve_redis
from tests.vllm.conftest import EngineRuns
from tests.vllm.engine_events import KVEvent, KVEventSubscriber
from tests.vllm.engine_workloads import CACHEABLE_TOKENS, overflow_rounds

BLOCK_BYTES = TINY.kv_bytes(32)
DISK_STORES = "vllm:kvtier_store_blocks_total"
MODEL_NAME = "tiny"


@dataclass(frozen=True)
class Reply:
    text: str
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class ServerScenario:
    first: Reply
    returned: Reply
    after_reset: Reply
    reset: dict[str, Any]
    metrics: str
    events: tuple[KVEvent, ...]
    stop_code: int | None  # None: still running long after the SIGTERM
    restarted: Reply
    forgotten: Reply
    restarted_stop_code: int | None


def complete(server: OpenAIServer, prompt: tuple[int, ...], max_tokens: int = 4) -> Reply:
    """One streaming completion through the OpenAI client; its text and usage."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=text_of(prompt, TINY.vocab),
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return Reply(text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0)


def metric(scrape: str, name: str, tier: str) -> float:
    """The value of `name{..., tier="tier"}` in a /metrics scrape (0 when absent)."""
    pattern = rf'^{re.escape(name)}\{{[^}}]*tier="{tier}"[^}}]*\}} (\S+)$'
    found = re.search(pattern, scrape, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="session")
def server_scenario(engine_runs: EngineRuns, tiny_model: Path) -> ServerScenario:
    return engine_runs.once("server-scenario", lambda workdir: _play(tiny_model, workdir))


def _play(tiny_model: Path, workdir: Path) -> ServerScenario:
    from kvtier.vllm import transfer_config

    model = chat_model(tiny_model, workdir / "model", TINY.vocab)
    first, _variant = overflow_rounds(TINY.vocab)[0].prompts
    variant = _variant
    fillers = overflow_rounds(TINY.vocab)[2].prompts
    probe = first[:16]  # no full block: a step that submits the stores left pending
    disk = {"disk_path": str(workdir / "disk"), "disk_bytes_to_use": 64 << 20}
    servers = serve_redis(workdir / "redis-dir" if _mkdir(workdir / "redis-dir") else workdir)
    redis = next(servers)
    try:
        config = transfer_config(cpu_bytes_to_use=8 * BLOCK_BYTES, redis_url=redis.url, **disk)
        with KVEventSubscriber("kvtier-server") as subscriber:
            events_config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": subscriber.endpoint,
                "topic": "kvtier-server",
            }
            server = _start(model, workdir, "server1", config, events_config)
            try:
                first_reply = complete(server, first)
                complete(server, variant)
                complete(server, first)  # a pool hit
                for filler in fillers:
                    complete(server, filler, max_tokens=1)
                returned = complete(server, first)
                scrape = _scrape(server, "vllm:kvtier_load_blocks_total", "disk", 1)
                reset = server.post("/reset_prefix_cache?reset_external=true")
                on_disk = metric(server.get("/metrics"), DISK_STORES, "disk")
                after_reset = complete(server, first)
                complete(server, probe)
                # vLLM's SIGTERM kills the engine at once (--shutdown-timeout 0): stop
                # once the recomputed prompt's blocks are on disk (written through)
                _scrape(server, DISK_STORES, "disk", on_disk + CACHEABLE_TOKENS // 32)
            finally:
                stop_code = server.stop(timeout_s=300)
    finally:
        next(servers, None)

    config = transfer_config(cpu_bytes_to_use=8 * BLOCK_BYTES, **disk)
    server = _start(model, workdir, "server2", config)
    try:
        restarted = complete(server, first)
        forgotten = complete(server, fillers[0], max_tokens=1)
    finally:
        restarted_stop_code = server.stop(timeout_s=300)
    return ServerScenario(
        first_reply,
        returned,
        after_reset,
        reset,
        scrape,
        tuple(subscriber.events),
        stop_code,
        restarted,
        forgotten,
        restarted_stop_code,
    )


def _start(
    model: Path,
    workdir: Path,
    name: str,
    kv_transfer_config: dict[str, Any],
    kv_events_config: dict[str, Any] | None = None,
) -> OpenAIServer:
    """A server with kvtier's tiers and a pool of 24 blocks (the overflow workload's),
    up; vLLM's own CPU binding (no side is compared with another here)."""
    config = ServerConfig(
        model,
        pool_blocks=24,
        max_model_len=512,
        max_num_seqs=4,
        kv_transfer_config=kv_transfer_config,
        kv_events_config=kv_events_config,
        served_name=MODEL_NAME,
        same_cpus=False,
    )
    return start_servers({name: config}, workdir)[name]


def _mkdir(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return True


def _scrape(
    server: OpenAIServer, name: str, tier: str, at_least: float, timeout_s: float = 60
) -> str:
    """/metrics once `name{tier}` has reached `at_least` (a bounded poll: the stores
    finish, and vLLM's stats reach its frontend, asynchronously)."""
    deadline = time.monotonic() + timeout_s
    scrape = server.get("/metrics")
    while metric(scrape, name, tier) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)  # a poll interval, not a synchronisation
        scrape = server.get("/metrics")
    return scrape


def test_streamed_completions_report_kvtier_hits_as_cached_tokens(
    server_scenario: ServerScenario,
) -> None:
    s = server_scenario
    assert s.first.prompt_tokens == 200 and s.first.cached_tokens == 0
    assert s.returned.cached_tokens == CACHEABLE_TOKENS  # from kvtier (disk), not the pool
    assert s.returned.text == s.first.text


def test_metrics_show_each_tier(server_scenario: ServerScenario) -> None:
    scrape = server_scenario.metrics
    assert metric(scrape, "vllm:kvtier_load_blocks_total", "disk") >= 1
    for tier in ("cpu", "disk", "redis"):
        assert metric(scrape, "vllm:kvtier_store_blocks_total", tier) > 0, tier
    assert metric(scrape, "vllm:kvtier_store_bytes_total", "redis") % BLOCK_BYTES == 0
    assert metric(scrape, "vllm:kvtier_capacity_blocks", "cpu") == 8
    assert metric(scrape, "vllm:kvtier_used_blocks", "cpu") == 8
    assert metric(scrape, "vllm:kvtier_evicted_blocks_total", "cpu") > 0
    assert metric(scrape, "vllm:kvtier_lookup_blocks_total", "redis") > 0
    assert metric(scrape, "vllm:kvtier_lookup_seconds_count", "redis") > 0
    assert metric(scrape, "vllm:kvtier_breaker_state", "redis") == 0
    for tier in ("disk", "redis"):  # (0 unless a worker's queue holds stores now)
        queued = rf'^vllm:kvtier_store_queue_bytes\{{[^}}]*tier="{tier}"[^}}]*\}} \S+$'
        assert re.search(queued, scrape, re.MULTILINE), tier
    assert "vllm:kvtier_load_time_total" in scrape


def test_kv_events_show_disk_and_redis_stores_with_their_medium(
    server_scenario: ServerScenario,
) -> None:
    stored = {(e.medium, e.locality) for e in server_scenario.events if e.kind == "BlockStored"}
    assert {("CPU", "LOCAL"), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")} <= stored


def test_a_reset_over_http_makes_kvtier_forget(server_scenario: ServerScenario) -> None:
    s = server_scenario
    assert s.reset == {"success": True}
    assert s.after_reset.cached_tokens == 0  # recomputed: no tier served it
    assert s.after_reset.text == s.first.text
    # the disk tier never filled: its removals are the reset's, reported as events
    removed = {(e.medium, e.locality) for e in s.events if e.kind == "BlockRemoved"}
    assert {("CPU", "LOCAL"), ("STORAGE", "LOCAL")} <= removed


def test_a_restart_after_sigterm_serves_the_cpu_tier_from_disk(
    server_scenario: ServerScenario,
) -> None:
    s = server_scenario
    assert s.stop_code == 0 and s.restarted_stop_code == 0
    assert s.restarted.cached_tokens == CACHEABLE_TOKENS  # in the CPU tier at the SIGTERM
    assert s.restarted.text == s.first.text
    assert s.forgotten.cached_tokens == 0  # stored before the reset: gone for good
