"""vLLM's OpenAI server with kvtier, started as a user starts it, for the end-to-end test.

`python -m vllm.entrypoints.openai.api_server` (the `vllm serve` of vLLM's CPU build,
whose `vllm` command looks up the package metadata of `vllm` and fails), on a loopback
port, with the README's `--kv-transfer-config`. The model directory is the engine
tests' tiny model plus kvtier's word-level tokenizer (`kvtier.vllm.engines.tokenizer`:
a prompt's `text_of` is exactly its tokens), so the server takes text and the prompts
are the engine tests' token ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.vllm.engines.run import _pythonpath

REPO_ROOT = Path(__file__).resolve().parents[2]

MODEL_NAME = "tiny"


class Server:
    """One server process (and its engine core), stopped by SIGTERM as in production."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        port: int,
        kv_transfer_config: dict[str, Any],
        kv_events_config: dict[str, Any] | None = None,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--block-size",
            "32",
            "--num-gpu-blocks-override",
            "24",
            "--kv-cache-memory-bytes",
            str(1 << 30),
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "4",
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--seed",
            "0",
            "--kv-transfer-config",
            json.dumps(kv_transfer_config),
        ]
        if kv_events_config is not None:
            args += ["--kv-events-config", json.dumps(kv_events_config)]
        # the dev endpoints include POST /reset_prefix_cache?reset_external=true
        env = {**os.environ, "PYTHONPATH": _pythonpath(), "VLLM_SERVER_DEV_MODE": "1"}
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            args,
            cwd=REPO_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 600) -> None:
        """Poll /health until it answers (bounded); a server that exits fails at once."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)  # a poll interval, not a synchronisation
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log()}")

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=60) as response:
            body: bytes = response.read()
        return body.decode()

    def post(self, path: str) -> Any:
        request = urllib.request.Request(self.url + path, data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    def stop(self, timeout_s: float = 300) -> int:
        """SIGTERM, as a process manager stops it; the exit code (SIGKILL after timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        code = self.proc.poll()
        # whatever vLLM left behind in the session (engine core, helpers)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        return -999 if code is None else code

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-8000:]
