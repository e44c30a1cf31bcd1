"""A TCP proxy that makes a link slow: a fixed delay per direction, a byte-rate cap, and a
stall on demand. For tests and benchmarks of a slow shared tier (a Redis across a
datacenter, or one under load), in front of a real server; stdlib only.

Why a proxy and not a slow server: every figure kvtier had was measured against a Redis
on the same machine, which answers at once. A fleet's Redis answers in milliseconds, and
slower under load, and may stop answering in the middle of a load. The proxy puts that
between the engine and a real `redis-server` without touching either.

Each direction of each connection has a reader thread, which takes bytes as they come
and stamps them, and a writer thread, which passes each chunk on once its delay has
passed, no faster than the rate cap, and not at all while the proxy is stalled. So a
delay adds latency without cutting throughput (chunks in flight overlap, as on a long
link), and a stall holds the bytes (up to `max_buffered_bytes` per direction; the
reader then stops reading, and the sender's socket fills) until `resume()`.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass

_CHUNK = 256 << 10


@dataclass(frozen=True)
class LinkProfile:
    """How the link is shaped. `up_delay_s`: client to server, `down_delay_s`: server to
    client (a round trip gets both); `rate_bytes_per_s`: each direction's cap (None: none)."""

    up_delay_s: float = 0.0
    down_delay_s: float = 0.0
    rate_bytes_per_s: float | None = None
    max_buffered_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("up_delay_s", "down_delay_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name}={value!r}; a number of seconds >= 0")
            if not 0 <= value < math.inf:
                raise ValueError(f"{name}={value!r}; a finite number of seconds >= 0")
        rate = self.rate_bytes_per_s
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf
        ):
            raise ValueError(f"rate_bytes_per_s={rate!r}; a number of bytes per second > 0")
        if self.max_buffered_bytes < _CHUNK:
            raise ValueError(f"max_buffered_bytes={self.max_buffered_bytes}; at least {_CHUNK}")

    @classmethod
    def round_trip(cls, added_s: float, rate_bytes_per_s: float | None = None) -> LinkProfile:
        """A link whose round trips take `added_s` longer, half each way."""
        if isinstance(added_s, bool) or not isinstance(added_s, int | float) or added_s < 0:
            raise ValueError(f"added round-trip seconds {added_s!r}; a number >= 0")
        return cls(added_s / 2, added_s / 2, rate_bytes_per_s)


class _Direction:
    """Bytes read from one socket, waiting to be written to the other."""

    def __init__(
        self, proxy: ShapingProxy, src: socket.socket, dst: socket.socket, up: bool
    ) -> None:
        self.proxy, self.src, self.dst, self.up = proxy, src, dst, up
        self.chunks: deque[tuple[float, bytes]] = deque()  # (due time, bytes)
        self.buffered = 0
        self.closed = False
        self.cond = threading.Condition()

    def read_loop(self) -> None:
        limit = self.proxy.profile.max_buffered_bytes
        try:
            while data := self.src.recv(_CHUNK):
                profile = self.proxy.profile  # read per chunk: `reshape` applies at once
                delay_s = profile.up_delay_s if self.up else profile.down_delay_s
                with self.cond:
                    self.cond.wait_for(lambda: self.buffered < limit or self.closed)
                    if self.closed:
                        return
                    self.chunks.append((time.monotonic() + delay_s, data))
                    self.buffered += len(data)
                    self.cond.notify_all()
                self.proxy.used_cpu()
        except OSError:
            pass
        finally:
            self.close()

    def write_loop(self) -> None:
        proxy = self.proxy
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: bool(self.chunks) or self.closed)
                    if not self.chunks:
                        return  # closed, and everything read was passed on
                    due, data = self.chunks[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                rate = proxy.profile.rate_bytes_per_s
                if rate is not None:  # the chunk takes its time on the link, then arrives
                    time.sleep(len(data) / rate)
                proxy.wait_flowing()
                proxy.count(len(data))  # before it arrives: a reader that got it sees it
                self.dst.sendall(data)
                proxy.used_cpu()
                with self.cond:
                    self.chunks.popleft()
                    self.buffered -= len(data)
                    self.cond.notify_all()
        except OSError:
            pass
        finally:
            self.close()
            _shutdown(self.dst)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class ShapingProxy:
    """Listens on 127.0.0.1 (`port`, a free one by default) and forwards every connection
    to `target`, shaped by `profile` (which `reshape` may change for new chunks)."""

    def __init__(
        self, target: tuple[str, int], profile: LinkProfile | None = None, port: int = 0
    ) -> None:
        self.target = target
        self.profile = profile or LinkProfile()
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.bytes_forwarded = 0
        self.connections = 0
        self._cpu: dict[int, float] = {}  # each thread's CPU seconds, by thread id
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True)
        self._acceptor.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def reshape(self, profile: LinkProfile) -> None:
        """Shape the link anew (bytes read from now on get the new delay and rate)."""
        self.profile = profile

    def stall(self) -> None:
        """Stop passing bytes on, both ways, until `resume()` (a server that stopped
        answering, a link that hangs): connections stay open, nothing arrives."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    @property
    def stalled(self) -> bool:
        return not self._flowing.is_set()

    def wait_flowing(self) -> None:
        while not self._flowing.wait(0.1):
            if self._closed:
                raise OSError("proxy closed")

    def count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_forwarded += nbytes

    def used_cpu(self) -> None:
        """The calling thread's CPU time so far, kept (see `cpu_seconds`)."""
        self._cpu[threading.get_ident()] = time.thread_time()

    @property
    def cpu_seconds(self) -> float:
        """CPU seconds the proxy's threads have spent passing bytes on: on a benchmark's
        machine this is taken from the engines beside it, which a real link would not
        take, so a benchmark reports it beside what it measured."""
        return sum(list(self._cpu.values()))

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
                self.connections += 1
            for src, dst, up in ((client, server, True), (server, client, False)):
                direction = _Direction(self, src, dst, up)
                threading.Thread(target=direction.read_loop, daemon=True).start()
                threading.Thread(target=direction.write_loop, daemon=True).start()

    def close(self) -> None:
        """Stop listening and cut every connection."""
        self._closed = True
        self._flowing.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _shutdown(sock)
            sock.close()

    def __enter__(self) -> ShapingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
