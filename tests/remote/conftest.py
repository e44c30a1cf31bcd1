"""A real redis-server per test, on a free loopback port, in a temp dir.

The server is started and stopped by the suite (never a shared system
instance): tests kill it, pause it and restart it on the same port. Readiness
is read from the server's own log line, so nothing sleeps.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.net import free_port
from kvtier.remote.tier import RemoteTier

REDIS_BIN = shutil.which("redis-server")
REPO_ROOT = Path(__file__).resolve().parents[2]
_READY = "Ready to accept connections"


def _redis_port() -> int:
    """A free port that a cluster node can take too: its cluster bus listens 10000 above
    it, so Redis refuses ports over 55535 (a fifth of Linux's ephemeral range)."""
    for _ in range(100):
        port = free_port()
        if port <= 55535:
            return port
    raise RuntimeError("no free port at or below 55535")


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls_files(directory: Path) -> TLSFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    files = TLSFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    ca_key = directory / "ca.key"
    ca, cert, key, csr = (str(f) for f in (files.ca, files.cert, files.key, directory / "s.csr"))
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    commands = [
        f"req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=kvtier-ca -keyout {ca_key} -out {ca}",
        f"req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout {key} -out {csr}",
        f"x509 -req -in {csr} -CA {ca} -CAkey {ca_key} -CAcreateserial -days 2 "
        f"-extfile {ext} -out {cert}",
    ]
    for command in commands:  # temp paths have no spaces
        subprocess.run(["openssl", *command.split()], check=True, capture_output=True, timeout=60)
    return files


class RedisServer:
    """One redis-server process that can be killed, paused and restarted in place."""

    def __init__(
        self, workdir: Path, password: str | None = None, *args: str, tls: TLSFiles | None = None
    ) -> None:
        self.workdir = workdir
        self.password = password
        self.args = args
        self.tls = tls
        self.port = _redis_port()
        self.proc: subprocess.Popen[str] | None = None
        self._drainer: threading.Thread | None = None
        self.started = False

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or restart on the same port); a first start retries on another free port."""
        for attempt in range(3):
            log = self._spawn()
            if log is None:
                self.started = True
                return
            if self.started or attempt == 2:
                raise RuntimeError(f"redis-server did not start on {self.port}: {log}")
            self.port = _redis_port()  # another process took the port between probe and bind

    def _spawn(self) -> str | None:
        """Run the server; None once it accepts connections, else its log."""
        assert REDIS_BIN is not None
        cmd = [REDIS_BIN, "--port", str(self.port), "--bind", "127.0.0.1"]
        if self.tls:
            cmd[1:3] = ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            cmd += ["--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key)]
            cmd += ["--tls-ca-cert-file", str(self.tls.ca)]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            [*cmd, *self.args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        ready = threading.Event()
        log: list[str] = []
        self._drainer = threading.Thread(target=_drain, args=(self.proc, ready, log), daemon=True)
        self._drainer.start()
        if not ready.wait(timeout=15) or not any(_READY in line for line in log):
            self.kill()
            return "".join(log)
        return None

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-conversation, as in a crash."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=15)
            if self._drainer is not None:
                self._drainer.join(timeout=15)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)


def _drain(proc: subprocess.Popen[str], ready: threading.Event, log: list[str]) -> None:
    """Read the server's log to the end, so its pipe never fills; flag readiness."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if len(log) < 200:
            log.append(line)
        if _READY in line:
            ready.set()
    ready.set()  # exited: start() then sees a dead process via the log


def require_redis() -> str:
    if REDIS_BIN is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server not found in CI (make redis-server installs it)")
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    return REDIS_BIN


def serve_redis(tmp_path: Path, password: str | None = None, *args: str) -> Iterator[RedisServer]:
    require_redis()
    server = RedisServer(tmp_path, password, *args)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.resume()
        server.kill()


@pytest.fixture(autouse=True)
def close_tiers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every `RemoteTier` a test opens is closed when it ends: a tier left open leaves
    its connections to be finalised by whichever later test collects garbage, which
    then fails on the ResourceWarning (warnings are errors here; a fresh-clone CI run
    failed so, in a test that called `gc.collect()`)."""
    opened: list[RemoteTier] = []
    init = RemoteTier.__init__

    def tracked(self: RemoteTier, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(RemoteTier, "__init__", tracked)
    yield
    for tier in opened:
        tier.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from serve_redis(tmp_path)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    if shutil.which("openssl") is None:
        # Not a dependency of Debian's redis-server (unlike redis-cli): a skip with
        # its reason, not a red CI, where the image lacks the openssl CLI.
        pytest.skip("openssl CLI not found: cannot make test certificates for rediss://")
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def redis_server_tls(tmp_path: Path, tls_files: TLSFiles) -> Iterator[RedisServer]:
    require_redis()
    server = RedisServer(tmp_path, None, tls=tls_files)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def redis_server_with_password(tmp_path: Path) -> Iterator[RedisServer]:
    yield from serve_redis(tmp_path, "s3cret-pw")


class FakeClock:
    """Virtual time for the circuit breaker: tests advance it instead of sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    """Three masters, all 16384 slots assigned by `redis-cli --cluster create`."""
    require_redis()
    cli = shutil.which("redis-cli")
    if cli is None:
        if os.environ.get("CI"):
            pytest.fail("redis-cli not found in CI (it ships with redis-server)")
        pytest.skip("redis-cli not found")
    nodes = []
    try:
        for i in range(3):
            workdir = tmp_path_factory.mktemp(f"cluster-node-{i}")
            node = RedisServer(workdir, None, "--cluster-enabled", "yes")
            node.start()
            nodes.append(node)
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        _await_cluster_ok(nodes)
        yield nodes
    finally:
        for node in nodes:
            node.kill()


def _await_cluster_ok(nodes: list[RedisServer], deadline_s: float = 30.0) -> None:
    """Poll until every node reports cluster_state:ok (gossip settles after `create`).

    The one wait in this suite: readiness of external processes that offer no
    event to block on. It polls a condition with a deadline; nothing is timed.
    """
    clients = [n.client() for n in nodes]
    deadline = time.monotonic() + deadline_s
    try:
        while not all(c.cluster("INFO")["cluster_state"] == "ok" for c in clients):
            if time.monotonic() > deadline:
                raise RuntimeError("the test cluster never reached cluster_state:ok")
            threading.Event().wait(0.05)
    finally:
        for client in clients:
            client.close()
