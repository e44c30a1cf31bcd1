"""vLLM's KV events, received as an external consumer (a router, a cache-aware load
balancer) receives them: a ZMQ SUB socket decoding the engine's msgpack batches.

The subscriber binds a free loopback port and vLLM's publisher connects to it
(`EngineJob.kv_events_endpoint`; an endpoint without `*` makes vLLM connect), so there
is no race for the port. Batches are decoded as plain msgpack, as a consumer in any
language would (vLLM's `KVEventBatch` is an array `[ts, events, dp_rank]`, each event a
map tagged with its class name under "type"), so the test process never imports vLLM.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any


@dataclass(frozen=True)
class KVEvent:
    kind: str  # "BlockStored", "BlockRemoved" or "AllBlocksCleared"
    medium: str | None
    block_hashes: tuple[Any, ...]
    token_ids: tuple[int, ...] = ()  # BlockStored only
    parent_block_hash: Any = None  # BlockStored only
    seq: int = -1  # the publisher's batch number
    locality: str | None = None  # with medium STORAGE: LOCAL (disk) or REMOTE (Redis)


class KVEventSubscriber:
    """Collects every event published while it is open (use as a context manager)."""

    def __init__(self, topic: str = "kvtier-test") -> None:
        import zmq

        self.topic = topic
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.bind("tcp://127.0.0.1:0")
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.events: list[KVEvent] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._receive, daemon=True)

    def __enter__(self) -> KVEventSubscriber:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Drain what is still queued, then close. Call after the engine has exited:
        vLLM flushes its queue on shutdown, so nothing arrives later."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()
        if self._error is not None:
            raise RuntimeError("the KV event subscriber failed") from self._error

    def _receive(self) -> None:
        try:
            self._receive_until_stopped()
        except BaseException as error:  # surfaced by close(), in the test's thread
            self._error = error

    def _receive_until_stopped(self) -> None:
        import msgspec

        decoder = msgspec.msgpack.Decoder()
        # once stopped, one last pass takes what is still in flight: it ends when
        # nothing has come for half a second (vLLM flushes its queue as it shuts down)
        while True:
            stopping = self._stop.is_set()
            while self._sock.poll(timeout=500 if stopping else 100):
                _topic, seq, payload = self._sock.recv_multipart()
                _ts, events, *_rank = decoder.decode(payload)
                self.events.extend(_event(e, int.from_bytes(seq, "big")) for e in events)
            if stopping:
                return


def _event(raw: dict[str, Any], seq: int) -> KVEvent:
    kind = raw["type"]
    hashes = tuple(raw.get("block_hashes", ()))
    medium, locality = raw.get("medium"), raw.get("locality")
    if kind == "BlockStored":
        tokens = tuple(raw["token_ids"])
        parent = raw.get("parent_block_hash")
        return KVEvent(kind, medium, hashes, tokens, parent, seq, locality)
    return KVEvent(kind, medium, hashes, seq=seq, locality=locality)
