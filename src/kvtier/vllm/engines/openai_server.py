"""vLLM's OpenAI server in a process of its own, as a user starts it, for the serving
benchmark and its test.

`python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails on vLLM's CPU
build), on a loopback port, in a session of its own (a kill of its process group ends
the engine core it spawned too), with `VLLM_SERVER_DEV_MODE=1` for `POST
/reset_prefix_cache?reset_external=true` between runs, and the CPU binding of an engine
without a connector whether or not it has one (`compare.same_cpus_env`): otherwise, on a
2-core machine, the engine with kvtier computes on both cores and the one without on one.
Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from kvtier.net import free_port
from kvtier.vllm.engines.compare import same_cpus_env
from kvtier.vllm.engines.run import _pythonpath, end_session


@dataclass(frozen=True)
class ServerConfig:
    """What differs between the servers a benchmark or a test starts."""

    model: Path  # a model directory with config.json and a tokenizer
    block_size: int = 32
    pool_blocks: int = 128  # the engine's pool (num_gpu_blocks_override)
    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None
    kv_transfer_config: dict[str, Any] | None = None  # None: vLLM alone
    served_name: str = "model"
    seed: int = 0

    def command(self, port: int) -> list[str]:
        weights = "safetensors" if (self.model / "model.safetensors").exists() else "dummy"
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(port),
            "--load-format", weights, "--dtype", "float32",
            "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.pool_blocks),
            "--kv-cache-memory-bytes", str(1 << 30),
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--enable-prefix-caching", "--enforce-eager", "--seed", str(self.seed),
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if self.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return args


class OpenAIServer:
    """One server process; `with` stops it (its whole session) whatever happened."""

    def __init__(self, config: ServerConfig, log_path: Path) -> None:
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {
            **os.environ,
            **same_cpus_env(),
            "PYTHONPATH": _pythonpath(),
            "VLLM_SERVER_DEV_MODE": "1",
        }
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                config.command(self.port),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    def wait_ready(self, deadline: float) -> None:
        """Poll /health until it answers or `deadline` (time.monotonic) passes; a server
        that exits fails at once, with its log."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in time:\n{self.log()}")
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(1.0)  # a start takes tens of seconds: a poll interval

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=60) as response:
            body: bytes = response.read()
        return body.decode()

    def post(self, path: str) -> Any:
        request = urllib.request.Request(self.url + path, data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    def reset(self) -> None:
        """Forget every cached block: the engine's pool and, with kvtier, its tiers."""
        answer = self.post("/reset_prefix_cache?reset_external=true")
        if answer != {"success": True}:
            raise RuntimeError(f"{self.url}: reset_prefix_cache answered {answer!r}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        end_session(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def start_servers(
    configs: dict[str, ServerConfig], workdir: Path, timeout_s: float = 600
) -> dict[str, OpenAIServer]:
    """Start every server at once (a start costs 20-90 s here) and wait for all; on a
    failure every one started is stopped."""
    servers: dict[str, OpenAIServer] = {}
    try:
        for name, config in configs.items():
            servers[name] = OpenAIServer(config, workdir / f"{name}.log")
        deadline = time.monotonic() + timeout_s
        for server in servers.values():
            server.wait_ready(deadline)
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


_KVTIER_SAMPLE = re.compile(r"^vllm:kvtier_(\w+?)(?:_total)?\{([^}]*)\} (\S+)$", re.MULTILINE)


def kvtier_counters(scrape: str) -> dict[str, dict[str, float]]:
    """kvtier's figures in a /metrics scrape, by tier then name (`hit_blocks`, ...;
    counters without vLLM's `_total`), summed over any other label."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in _KVTIER_SAMPLE.findall(scrape):
        tier = re.search(r'tier="([^"]*)"', labels)
        if tier is None or name.endswith(("_bucket", "_created")):
            continue
        figures = out.setdefault(tier.group(1), {})
        figures[name] = figures.get(name, 0.0) + float(value)
    return out
