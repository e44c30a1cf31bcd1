"""The shaping proxy in a process of its own, at a scheduling priority of its own.

Why: in a benchmark's process the proxy's threads share the load client's interpreter
lock, and only while the kvtier side runs; in a child process they share only the
cores, and the child's CPU time is counted whole (`cpu_seconds`, every thread). `nice`
lowers its priority: at 19, beside an engine that keeps both cores busy, the link gets
next to no CPU, a stand-in for a Redis starved by the machine it runs on (measured in
`bench_serving`: every store timed out), not for one on other machines. The child
answers each command on a line of JSON, so `stall()` has taken effect when it returns.

Run as `python -m kvtier.remote.proxy_process HOST PORT [--nice N]` (what `ProxyProcess`
does): it prints its listening port, then serves commands on stdin.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import IO, Any

from kvtier.remote.shaping_proxy import LinkProfile, ShapingProxy

_START_TIMEOUT_S = 30.0


def check_nice(nice: int) -> int:
    """`nice` as a niceness a process may add to its own (0 to 19)."""
    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
        raise ValueError(f"nice={nice!r}; an integer from 0 (the default priority) to 19")
    return nice


class ProxyProcess:
    """`ShapingProxy`'s controls (`url`, `reshape`, `stall`, `resume`, `cpu_seconds`,
    `bytes_forwarded`) for a proxy running in a child process at niceness `nice`."""

    def __init__(
        self, target: tuple[str, int], profile: LinkProfile | None = None, nice: int = 0
    ) -> None:
        host, port = target
        cmd = [sys.executable, "-m", __name__, host, str(port), "--nice", str(check_nice(nice))]
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._lock = threading.Lock()
        try:
            self.port = int(self._reply(_START_TIMEOUT_S)["port"])
            if profile is not None:
                self.reshape(profile)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self._proc.pid

    def reshape(self, profile: LinkProfile) -> None:
        self._call({"op": "reshape", "profile": asdict(profile)})

    def stall(self) -> None:
        self._call({"op": "stall"})

    def resume(self) -> None:
        self._call({"op": "resume"})

    @property
    def cpu_seconds(self) -> float:
        """The child's CPU seconds so far, every thread of it (user and system)."""
        return float(self._call({"op": "stats"})["cpu_s"])

    @property
    def bytes_forwarded(self) -> int:
        return int(self._call({"op": "stats"})["bytes"])

    def _call(self, command: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            stdin = self._proc.stdin
            if stdin is None or self._proc.poll() is not None:
                raise RuntimeError(f"the proxy process exited ({self._proc.returncode})")
            stdin.write(json.dumps(command) + "\n")
            stdin.flush()
            return self._reply(None)

    def _reply(self, timeout_s: float | None) -> dict[str, Any]:
        stdout = self._proc.stdout
        assert stdout is not None
        if timeout_s is not None:  # the start: a child that never answers is an error
            timer = threading.Timer(timeout_s, self._proc.kill)
            timer.start()
        try:
            line = stdout.readline()
        finally:
            if timeout_s is not None:
                timer.cancel()
        if not line:
            raise RuntimeError(f"the proxy process exited ({self._proc.wait()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the proxy process: {reply['error']}")
        return reply

    def close(self) -> None:
        if self._proc.poll() is None:
            with self._lock:
                if self._proc.stdin is not None:
                    self._proc.stdin.close()  # the child's loop ends at end of input
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(proxy: ShapingProxy, commands: IO[str], replies: IO[str]) -> None:
    """Answer each command line until the end of `commands`."""
    for line in commands:
        try:
            command = json.loads(line)
            op = command["op"]
            reply: dict[str, Any] = {"ok": True}
            if op == "reshape":
                proxy.reshape(LinkProfile(**command["profile"]))
            elif op == "stall":
                proxy.stall()
            elif op == "resume":
                proxy.resume()
            elif op == "stats":
                reply = {"cpu_s": time.process_time(), "bytes": proxy.bytes_forwarded}
            else:
                raise ValueError(f"op {op!r}; one of reshape, stall, resume, stats")
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--nice", type=int, default=0)
    args = parser.parse_args(argv)
    os.nice(check_nice(args.nice))  # before any thread: each inherits it
    with ShapingProxy((args.host, args.port)) as proxy:
        print(json.dumps({"port": proxy.port}), flush=True)
        serve(proxy, sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
