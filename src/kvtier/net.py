"""Loopback ports for the servers that tests and benchmarks start (vLLM's, Redis, the
router): stdlib only, so that suites without vLLM or the router use it too."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port no one listens on now; the caller binds it soon, and a server that loses it
    to another process in between fails its start (callers retry or report that)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
