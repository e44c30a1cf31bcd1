"""Stand-ins for vLLM servers on loopback: an OpenAI endpoint that says who answered,
and a KV-event publisher speaking vLLM's ZMQ protocol (PUB with numbered batches, a
ROUTER socket replaying its buffer), so the router's faults can be driven at will."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from kvtier.router.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

Event = BlockStored | BlockRemoved | AllBlocksCleared


def stored(hashes: list[bytes], medium: str = "GPU", locality: str | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        locality=locality,
    )


def removed(hashes: list[bytes], medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


class FakeEngine:
    """`mode`: "ok", "hang" (takes requests, never answers) or "sick" (/health fails)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.port = 0
        self.served = 0
        self.drops = 0  # requests whose connection is closed without an answer
        self._runner: web.AppRunner | None = None
        self._release = asyncio.Event()  # ends hanging requests at stop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(middlewares=[_no_keepalive])
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self._release = asyncio.Event()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=500 if self.mode == "sick" else 200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.drops:
            self.drops -= 1
            assert request.transport is not None
            request.transport.close()  # what a server closing an idle connection looks like
            return web.Response()
        if self.mode == "hang":
            await self._release.wait()
        self.served += 1
        answer = {"engine": self.name, "usage": {"prompt_tokens": 1}}
        if not body.get("stream"):
            return web.json_response(answer)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        out.force_close()
        await out.prepare(request)
        for word in ("a", "b", "c"):
            chunk = {"engine": self.name, "choices": [{"text": word}]}
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


@web.middleware
async def _no_keepalive(request: web.Request, handler: Any) -> web.StreamResponse:
    """Each connection closes with its answer: a stopped fake then leaves no idle
    server-side connection behind (aiohttp's cleanup does not close those)."""
    response: web.StreamResponse = await handler(request)
    if not response.prepared:
        response.force_close()
    return response


class FakePublisher:
    """vLLM's ZmqEventPublisher's wire protocol: (topic, seq, payload) on PUB; a replay
    request (the first seq wanted) on ROUTER gets the buffered batches and an end marker."""

    def __init__(self, ctx: zmq.asyncio.Context, directory: Path, name: str, topic: str = "kv"):
        self.endpoint = f"ipc://{directory}/{name}.events"
        self.replay_endpoint = f"ipc://{directory}/{name}.replay"
        self.topic = topic
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self._pub = ctx.socket(zmq.PUB)
        self._pub.bind(self.endpoint)
        self._router = ctx.socket(zmq.ROUTER)
        self._router.bind(self.replay_endpoint)
        self.replays = 0
        self.ignore_replays = 0  # replay requests to leave unanswered (a stalled publisher)
        self._task = asyncio.create_task(self._serve_replay())

    def publish(self, events: list[Event], *, payload: bytes | None = None, send: bool = True):
        """Publish the next batch (`send=False`: buffer it only, a batch the subscriber
        missed)."""
        data = payload if payload is not None else encode_batch(events, time.time())
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, data))
        if send:
            self._pub.send_multipart((self.topic.encode(), seq.to_bytes(8, "big"), data))

    def restart(self) -> None:
        """A new engine process: numbering starts over and the buffer is empty."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self._router.recv_multipart()
            self.replays += 1
            if self.ignore_replays > 0:
                self.ignore_replays -= 1
                continue
            first = int.from_bytes(start, "big")
            for seq, data in self.buffer:
                if seq >= first:
                    await self._router.send_multipart(
                        (client, b"", self.topic.encode(), seq.to_bytes(8, "big"), data)
                    )
            await self._router.send_multipart(
                (client, b"", b"", (-1).to_bytes(8, "big", signed=True), b"")
            )

    def close(self) -> None:
        self._task.cancel()
        self._pub.close(linger=0)
        self._router.close(linger=0)


async def until(condition: Callable[[], Any], what: str, timeout_s: float = 20.0) -> None:
    """Poll `condition` until true, failing after `timeout_s` (a bound, not a sleep)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def until_answered(probe: Callable[[], Awaitable[bool]], what: str, timeout_s: float) -> None:
    """`until` for a condition that takes a round trip to learn."""
    deadline = time.monotonic() + timeout_s
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
