"""vLLM's OpenAI server in a process of its own, as a user starts it: the one way the
benchmarks and the tests start one (the serving benchmark, the router's, the end-to-end
tests).

`python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails on vLLM's CPU
build), on a loopback port, in a session of its own (a kill of its process group ends
the engine core it spawned too), with `VLLM_SERVER_DEV_MODE=1` for `POST
/reset_prefix_cache?reset_external=true` between runs. By default with the CPU binding
of an engine without a connector whether or not it has one (`compare.same_cpus_env`):
otherwise, on a 2-core machine, the engine with kvtier computes on both cores and the
one without on one. Servers start together (a start costs 20-90 s here) and are waited
for against one deadline. Nothing here imports vLLM.
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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvtier.net import free_port
from kvtier.vllm.engines.compare import same_cpus_env
from kvtier.vllm.engines.run import _pythonpath, end_session
from kvtier.vllm.engines.sessions import session_cpu_seconds, session_thread_cpu_seconds


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
    kv_events_config: dict[str, Any] | None = None  # None: no KV events
    served_name: str = "model"
    seed: int = 0
    # flags only some callers want: the router's servers hash as the router does
    # (`--prefix-caching-hash-algo sha256_cbor`) and keep their logs short
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # e.g. VLLM_LOGGING_LEVEL
    # False where no side is compared with another: vLLM's own binding
    same_cpus: bool = True
    # the interpreter that runs the server: the caller's, or a peer's environment over
    # the same vLLM (benchmarks/bench_peers.py runs LMCache's side from .venv-peers)
    python: str | None = None

    def command(self, port: int) -> list[str]:
        weights = "safetensors" if (self.model / "model.safetensors").exists() else "dummy"
        args = [
            self.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
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
        if self.kv_events_config is not None:
            args += ["--kv-events-config", json.dumps(self.kv_events_config)]
        return [*args, *self.extra_args]

    def environment(self) -> dict[str, str]:
        return {
            **os.environ,
            **(same_cpus_env() if self.same_cpus else {}),
            **self.env,
            "PYTHONPATH": _pythonpath(),
            "VLLM_SERVER_DEV_MODE": "1",
        }


class OpenAIServer:
    """One server process; `with` stops it (its whole session) whatever happened."""

    def __init__(self, config: ServerConfig, log_path: Path, name: str = "") -> None:
        self.config = config
        self.name = name or log_path.stem
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                config.command(self.port),
                env=config.environment(),
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
        """Poll /health until it answers or `deadline` (time.monotonic) passes: one
        deadline for servers started together. A server that exits fails at once, with
        its log."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"server {self.name} not ready in time:\n{self.log_tail()}")
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(1.0)  # a start takes tens of seconds: a poll interval

    def cpu_seconds(self) -> float:
        """CPU seconds (user and system) so far of every live process of the server's
        session: the API server, the engine core, its workers. A benchmark's figure
        beside its timings: what each side took from the cores both share."""
        return session_cpu_seconds(self.proc.pid)

    def thread_cpu_seconds(self) -> dict[str, float]:
        """`cpu_seconds` by process title and thread name (`session_thread_cpu_seconds`)."""
        return session_thread_cpu_seconds(self.proc.pid)

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

    def stop(self, timeout_s: float = 30) -> int | None:
        """SIGTERM, as a process manager stops a server, then `kill` whatever is left of
        its session. The server's exit code, None when it did not exit in `timeout_s`
        (a clean shutdown is part of what the end-to-end test checks)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        code = self.proc.poll()
        self.kill()
        return code

    def kill(self) -> None:
        """SIGKILL the server and every process of its session at once, as a crash
        does (the router's test kills an engine mid-run)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        end_session(self.proc.pid)

    def log_tail(self, chars: int = 6000) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]


def start_servers(
    configs: Mapping[str, ServerConfig], workdir: Path, timeout_s: float = 600
) -> dict[str, OpenAIServer]:
    """Start every server at once (a start costs 20-90 s here) and wait for all, each
    logging to `workdir/NAME.log`; on a failure every one started is stopped."""
    servers: dict[str, OpenAIServer] = {}
    try:
        for name, config in configs.items():
            servers[name] = OpenAIServer(config, workdir / f"{name}.log", name)
        deadline = time.monotonic() + timeout_s
        for server in servers.values():
            server.wait_ready(deadline)
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


@contextlib.contextmanager
def running_servers(
    configs: Mapping[str, ServerConfig], workdir: Path, timeout_s: float = 600
) -> Iterator[dict[str, OpenAIServer]]:
    """`start_servers`, and every server stopped on the way out whatever happened."""
    servers = start_servers(configs, workdir, timeout_s)
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


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
