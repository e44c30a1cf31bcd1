"""The sides bench_peers puts next to each other, each as its user would configure it.

- `vllm`: vLLM's OpenAI server alone (prefix caching in its pool only);
- `kvtier`: the same server with kvtier's CPU tier (`KvtierConnector`);
- `lmcache`: the same server with LMCache 0.5.6 in its multiprocess mode: its own server
  process (`lmcache server`, L1 in CPU memory, the engine copying into LMCache's shared
  memory: `engine_driven`) and vLLM's `LMCacheMPConnector` in the engine, run by the
  interpreter of `.venv-peers` (`make peers`), never the project's environment;
- `offloading`: vLLM's own `OffloadingConnector` with `CPUOffloadingSpec`, where vLLM's
  platform has its copy kernels (CUDA or XPU); vLLM's CPU build refuses it.

Same capacity: kvtier's `cpu_bytes_to_use`, LMCache's `--l1-size-gb` and vLLM's
`cpu_bytes_to_use` are one byte budget. LMCache as its documentation recommends here:
chunks of the engine's block size (a chunk is LMCache's unit of storing and hitting),
LRU eviction, L1 memory for the whole working set.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from kvtier.net import free_port
from kvtier.vllm import transfer_config
from kvtier.vllm.engines.openai_server import ServerConfig
from kvtier.vllm.engines.run import end_session

LMCACHE_VERSION = "0.5.6"
GIB = 1 << 30


@dataclass(frozen=True)
class LMCacheSettings:
    """LMCache's server flags that bench_peers varies (the rest are fixed)."""

    chunk_size: int = 32  # tokens; the engine's block size
    eviction_policy: str = "LRU"
    l1_bytes: int = GIB

    def __post_init__(self) -> None:
        if self.l1_bytes % (GIB // 1024):
            raise ValueError(f"l1_bytes={self.l1_bytes}; LMCache sizes L1 in whole MiB")


class LMCacheServer:
    """`lmcache server` in a session of its own; `with` stops it whatever happened."""

    def __init__(
        self,
        peers_bin: Path,
        settings: LMCacheSettings,
        log_path: Path,
        extra_args: tuple[str, ...] = (),  # e.g. an `--l2-adapter` (its local disk)
    ) -> None:
        self.port, self.http_port, self.prometheus_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = log_path
        command = [
            str(peers_bin / "lmcache"), "server",
            "--port", str(self.port), "--http-port", str(self.http_port),
            "--prometheus-port", str(self.prometheus_port),
            "--l1-size-gb", f"{settings.l1_bytes / GIB:g}",
            "--eviction-policy", settings.eviction_policy,
            "--chunk-size", str(settings.chunk_size),
            "--supported-transfer-mode", "engine_driven",
            "--shm-name", f"kvtier-bench-peers-{self.port}", *extra_args,
        ]  # fmt: skip
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def __enter__(self) -> LMCacheServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(self.url + "/healthcheck", timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.5)  # a start takes seconds: a poll interval
        tail = self.log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"lmcache server not ready (exit {self.proc.poll()}):\n{tail}")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            body: bytes = response.read()
        return body.decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        end_session(self.proc.pid)
        self.proc.wait()


def lmcache_transfer_config(port: int) -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://localhost",
            "lmcache.mp.port": port,
        },
    }


def offloading_transfer_config(cpu_bytes: int) -> dict[str, Any]:
    """vLLM's own CPU offloading, as its documentation configures it."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CPUOffloadingSpec",
            "cpu_bytes_to_use": cpu_bytes,
        },
    }


def side_configs(
    alone: ServerConfig,
    cpu_bytes: int,
    lmcache: LMCacheServer | None,
    peers_python: Path,
    offloading: bool,
) -> dict[str, ServerConfig]:
    """Every side's server: `alone`'s model, pool, flags and CPU binding, plus its
    connector; all sides hold `cpu_bytes` of offloaded KV."""
    configs = {
        "vllm": alone,
        "kvtier": replace(alone, kv_transfer_config=transfer_config(cpu_bytes_to_use=cpu_bytes)),
    }
    if lmcache is not None:
        configs["lmcache"] = replace(
            alone,
            kv_transfer_config=lmcache_transfer_config(lmcache.port),
            env={**alone.env, "LMCACHE_MP_TRANSFER_MODE": "engine_driven"},
            python=str(peers_python),
        )
    if offloading:
        configs["offloading"] = replace(
            alone, kv_transfer_config=offloading_transfer_config(cpu_bytes)
        )
    return configs


def offloading_runs_here(python: str) -> tuple[bool, str]:
    """Whether vLLM's `CPUOffloadingSpec` can run on this machine's vLLM platform (its
    worker's copy kernels need CUDA or XPU), and why not."""
    probe = "from vllm.platforms import current_platform as p; print(p.device_type)"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    device = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "unknown"
    if device in ("cuda", "xpu"):
        return True, device
    return False, (
        f"vLLM's platform here is {device!r}: its CPUOffloadingSpec refuses it "
        "(the worker's copy kernels need CUDA or XPU)"
    )
