"""The router's HTTP side: an OpenAI-compatible proxy in front of vLLM servers.

`/v1/completions` and `/v1/chat/completions` (streaming or not) are routed: the
prompt's block hashes are scored against the index (`kvtier.router.scoring`) and
the request is forwarded as it came. `/v1/models` goes to any engine that is up;
`/health` says whether one is; `/metrics` is Prometheus text.

Faults: an engine that refuses the connection, drops it, answers 502-504 or sends
nothing for `request_timeout_s` is taken out, its index entries dropped, and the
request goes to the next best engine; the client sees no error as long as one
engine answers (a stream already begun cannot move: it ends where the engine
stopped). A background check asks every engine's `/health` each
`health_interval_s`, takes out those that fail it and puts back those that answer,
rebuilding their entries from their publisher's replay buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import zmq.asyncio
from aiohttp import web

from kvtier.router.config import ENGINE_HEADER, RouterConfig
from kvtier.router.index import BlockIndex
from kvtier.router.metrics import CONTENT_TYPE, metrics_text
from kvtier.router.prompts import PromptError, PromptHasher
from kvtier.router.scoring import Chooser, Decision
from kvtier.router.state import EngineState, RouterCounters
from kvtier.router.subscriber import EventSubscriber
from kvtier.types import BlockHash

log = logging.getLogger(__name__)

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
_ENGINE_DOWN_STATUSES = frozenset({502, 503, 504})
_HOP_HEADERS = ("Authorization", "X-Request-Id")
_KEEPALIVE_S = 3.0


@dataclass(frozen=True)
class RouteRecord:
    """One routing decision (kept when `Router(keep_decisions=N)`)."""

    path: str
    engine: str
    reason: str
    cached_blocks: int
    prompt_blocks: int
    tokens: tuple[int, ...] = ()


class Router:
    def __init__(
        self,
        config: RouterConfig,
        hasher: PromptHasher | None = None,
        *,
        keep_decisions: int = 0,
    ) -> None:
        self.config = config
        self.index = BlockIndex()
        self.chooser = Chooser(config.policy, config.weights)
        self.hasher = hasher or PromptHasher(config.block_size, config.model_dir, config.hash_seed)
        self.engines = {spec.name: EngineState(spec) for spec in config.engines}
        self.counters = RouterCounters()
        self.decisions: deque[RouteRecord] = deque(maxlen=keep_decisions or None)
        self._keep_decisions = keep_decisions
        self._session: aiohttp.ClientSession | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self.health_rounds = 0  # completed rounds of health checks

    # --- lifecycle -----------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        for path in ROUTED_PATHS:
            app.router.add_post(path, self._route)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on host:port (0: a free port); returns the port."""
        # idle connections closed before the servers' own keep-alive ends (uvicorn's: 5 s)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(connector=connector)
        self._ctx = zmq.asyncio.Context()
        for state in self.engines.values():
            if state.spec.events is not None:
                state.subscriber = EventSubscriber(
                    state.spec, self.index, self._ctx, self.config.replay_timeout_s
                )
                self._tasks.append(asyncio.create_task(self._guard(state.subscriber.run())))
        self._tasks.append(asyncio.create_task(self._guard(self._check_health())))
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._runner is not None:
            await self._runner.cleanup()
        for state in self.engines.values():
            if state.subscriber is not None:
                state.subscriber.close()
        if self._ctx is not None:
            self._ctx.term()
        if self._session is not None:
            await self._session.close()

    @staticmethod
    async def _guard(coroutine: Any) -> None:
        """A background task that fails is logged, not lost."""
        try:
            await coroutine
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kvtier router: a background task failed")

    # --- routing -------------------------------------------------------------

    def prompt_hashes(self, path: str, body: dict[str, Any]) -> tuple[list[int], list[BlockHash]]:
        try:
            tokens = self.hasher.tokens(path, body)
            return tokens, self.hasher.hashes_of(tokens, body)
        except (PromptError, ValueError, TypeError) as error:
            self.counters.prompt_errors += 1
            log.debug("kvtier router: routing cold, no prompt hashes: %s", error)
            return [], []

    def decide(self, hashes: list[BlockHash], exclude: set[str]) -> Decision | None:
        names = [n for n, s in self.engines.items() if s.up and n not in exclude]
        if not names:  # the health check may be wrong: try those taken out last
            names = [n for n in self.engines if n not in exclude]
        if not names:
            return None
        return self.chooser.choose(
            names,
            len(hashes),
            lambda engine: self.index.prefix_tiers(engine, hashes),
            lambda engine: self.engines[engine].in_flight,
        )

    async def _route(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        self.counters.requests += 1
        # tokenizing a long prompt takes milliseconds: not on the loop that serves
        tokens, hashes = await asyncio.to_thread(self.prompt_hashes, request.path, body)
        tried: set[str] = set()
        while (decision := self.decide(hashes, tried)) is not None:
            state = self.engines[decision.engine]
            reasons = self.counters.by_reason
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
            if self._keep_decisions:
                self.decisions.append(
                    RouteRecord(
                        request.path,
                        decision.engine,
                        decision.reason,
                        decision.cached_blocks,
                        len(hashes),
                        tuple(tokens),
                    )
                )
            self.index.routed(decision.engine, hashes, self.config.routed_ttl_s)
            state.in_flight += 1
            try:
                response = await self._forward(state, request, raw)
            finally:
                state.in_flight -= 1
            if response is not None:
                state.requests += 1
                return response
            state.failures += 1
            tried.add(state.name)
            self.counters.retries += 1
        self.counters.unanswered += 1
        return _error(503, "no engine answered")

    async def _forward(
        self, state: EngineState, request: web.Request, raw: bytes
    ) -> web.StreamResponse | None:
        """The engine's answer, passed on; None when the engine failed before it began."""
        assert self._session is not None
        cfg = self.config
        timeout = aiohttp.ClientTimeout(
            total=None, connect=cfg.connect_timeout_s, sock_read=cfg.request_timeout_s
        )
        headers = {"Content-Type": "application/json"}
        headers.update({h: request.headers[h] for h in _HOP_HEADERS if h in request.headers})
        url = state.spec.url + request.path
        upstream = None
        for attempt in range(2):
            try:
                upstream = await self._session.post(url, data=raw, headers=headers, timeout=timeout)
                break
            except aiohttp.ServerDisconnectedError as error:
                # a pooled keep-alive connection the server had just closed: once more
                # on a new one before blaming the engine
                if attempt:
                    self._take_out(state, f"{type(error).__name__}: {error}")
            except (aiohttp.ClientError, TimeoutError, OSError) as error:
                self._take_out(state, f"{type(error).__name__}: {error}")
                return None
        if upstream is None:
            return None
        async with upstream:
            if upstream.status in _ENGINE_DOWN_STATUSES:
                self._take_out(state, f"status {upstream.status}")
                return None
            content_type = upstream.headers.get("Content-Type", "application/json")
            if not content_type.startswith("text/event-stream"):
                try:
                    data = await upstream.read()
                except (aiohttp.ClientError, TimeoutError, OSError) as error:
                    self._take_out(state, f"{type(error).__name__}: {error}")
                    return None
                return web.Response(
                    body=data,
                    status=upstream.status,
                    headers={"Content-Type": content_type, ENGINE_HEADER: state.name},
                )
            out = web.StreamResponse(
                status=upstream.status,
                headers={
                    "Content-Type": content_type,
                    "Cache-Control": "no-cache",
                    ENGINE_HEADER: state.name,
                },
            )
            await out.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError):
                self._take_out(state, "the stream broke off")
            await out.write_eof()
            return out

    def _take_out(self, state: EngineState, why: str) -> None:
        if state.up:
            log.warning("kvtier router: engine %s taken out (%s)", state.name, why)
            state.up = False
            state.taken_out += 1
        self.index.drop_engine(state.name)

    def _put_back(self, state: EngineState) -> None:
        log.info("kvtier router: engine %s is back", state.name)
        state.up = True
        if state.subscriber is not None:
            state.subscriber.resync()

    async def _check_health(self) -> None:
        while True:
            await asyncio.gather(*(self._check(s) for s in self.engines.values()))
            self.health_rounds += 1
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, state: EngineState) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self._session.get(state.spec.url + "/health", timeout=timeout) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        if ok and not state.up:
            self._put_back(state)
        elif not ok and state.up:
            self._take_out(state, "its /health did not answer 200")

    # --- the other endpoints ---------------------------------------------------

    async def _models(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s * 5)
        for state in sorted(self.engines.values(), key=lambda s: not s.up):
            try:
                async with self._session.get(state.spec.url + "/v1/models", timeout=timeout) as r:
                    return web.Response(
                        body=await r.read(), status=r.status, content_type="application/json"
                    )
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue
        return _error(503, "no engine answered")

    async def _health(self, request: web.Request) -> web.StreamResponse:
        up = {name: state.up for name, state in self.engines.items()}
        return web.json_response({"engines": up}, status=200 if any(up.values()) else 503)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body = metrics_text(self.counters, self.engines, self.index)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "kvtier_router", "code": status}}, status=status
    )


async def serve(config: RouterConfig, host: str, port: int) -> None:
    """Run a router until cancelled (the `kvtier route` command)."""
    router = Router(config)
    bound = await router.start(host, port)
    log.warning("kvtier router on http://%s:%d, %d engines", host, bound, len(router.engines))
    try:
        await asyncio.Event().wait()
    finally:
        await router.stop()


@contextlib.contextmanager
def router_thread(router: Router, host: str = "127.0.0.1", port: int = 0) -> Iterator[int]:
    """Run `router` on its own event loop in a thread (tests, benchmarks); yields its port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="kvtier-router")
    thread.start()
    port_future = asyncio.run_coroutine_threadsafe(router.start(host, port), loop)
    try:
        yield port_future.result(timeout=60)
    finally:
        asyncio.run_coroutine_threadsafe(router.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=60)
        loop.close()
