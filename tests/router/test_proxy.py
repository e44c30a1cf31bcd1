"""The router against fake engines on loopback: routing by the index, streaming, and
every fault the router must absorb (an engine refusing, hanging, failing its health
check and coming back; events missed, malformed, or restarting from zero)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq.asyncio

from kvtier.router import EngineSpec, PromptHasher, RouterConfig, Tier
from kvtier.router.index import BlockIndex
from kvtier.router.proxy import Router
from kvtier.router.subscriber import EventCounters
from tests.router.fakes import FakeEngine, FakePublisher, removed, stored, until

BLOCK = 16
PROMPT = list(range(100, 100 + 4 * BLOCK))  # four full blocks
HASHES = PromptHasher(BLOCK).hashes("/v1/completions", {"prompt": PROMPT})


def cold(i: int) -> list[int]:
    """A prompt of four blocks that no other request shares."""
    return [1000 * (i + 1) + t for t in range(4 * BLOCK)]


@dataclass
class Setup:
    router: Router
    engines: list[FakeEngine]
    publishers: list[FakePublisher]
    session: aiohttp.ClientSession
    base: str

    async def post(self, path: str = "/v1/completions", **body: Any) -> tuple[int, Any]:
        body.setdefault("prompt", PROMPT)
        async with self.session.post(self.base + path, json=body) as r:
            text = await r.text()
            return r.status, (json.loads(text) if not body.get("stream") else text)


@asynccontextmanager
async def setup(
    tmp_path: Path, n: int = 2, events: bool = True, **config: Any
) -> AsyncIterator[Setup]:
    ctx = zmq.asyncio.Context()
    engines = [FakeEngine(f"e{i}") for i in range(n)]
    for engine in engines:
        await engine.start()
    publishers = [FakePublisher(ctx, tmp_path, f"e{i}") for i in range(n)] if events else []
    specs = tuple(
        EngineSpec(
            e.url,
            events=publishers[i].endpoint if events else None,
            replay=publishers[i].replay_endpoint if events else None,
            topic="kv",
            name=e.name,
        )
        for i, e in enumerate(engines)
    )
    defaults: dict[str, Any] = {"health_interval_s": 0.05, "request_timeout_s": 5.0}
    router = Router(RouterConfig(specs, block_size=BLOCK, **(defaults | config)))
    port = await router.start()
    await until(lambda: router.health_rounds >= 1, "the first health checks")
    for state, publisher in zip(router.engines.values(), publishers, strict=False):
        await _subscribed(state.subscriber, publisher)
    session = aiohttp.ClientSession()
    try:
        yield Setup(router, engines, publishers, session, f"http://127.0.0.1:{port}")
    finally:
        await session.close()
        await router.stop()
        for p in publishers:
            p.close()
        for engine in engines:
            await engine.stop()
        ctx.term()


async def _subscribed(subscriber: Any, publisher: FakePublisher) -> None:
    """Empty batches until one arrives: a SUB socket misses what is published before
    it is connected (a later batch would have the gap replayed, but a test wants its
    first batch to count)."""
    for _ in range(200):
        publisher.publish([])
        try:
            await until(lambda: subscriber.counters.batches > 0, "a batch", timeout_s=0.1)
            return
        except AssertionError:
            continue
    raise AssertionError("the router never received a batch")


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def test_a_request_goes_to_the_engine_holding_its_prefix(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path) as s:
            s.publishers[1].publish([stored(HASHES[:3])])
            await until(lambda: s.router.index.held_blocks("e1") == 3, "e1's blocks")
            for _ in range(3):  # not by turn: every time
                status, answer = await s.post()
                assert (status, answer["engine"]) == (200, "e1")
            assert s.router.counters.by_reason == {"prefix": 3}

    run(scenario)


def test_a_shared_block_counts_for_every_engine_and_gpu_beats_cpu(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path) as s:
            # e0: 2 blocks in its pool; e1: the same 2 on its CPU tier, then a shared third
            s.publishers[0].publish([stored(HASHES[:2])])
            s.publishers[1].publish([stored(HASHES[:2], "CPU")])
            s.publishers[1].publish([stored(HASHES[2:3], "STORAGE", "REMOTE")])
            await until(lambda: s.router.index.shared_blocks() == 1, "the shared block")
            assert s.router.index.prefix_tiers("e0", HASHES) == [Tier.GPU, Tier.GPU, Tier.SHARED]
            assert s.router.index.prefix_tiers("e1", HASHES) == [Tier.CPU, Tier.CPU, Tier.SHARED]
            _, answer = await s.post()
            assert answer["engine"] == "e0"

    run(scenario)


def test_cold_prompts_take_turns(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path, n=3) as s:
            answers = [(await s.post(prompt=cold(i)))[1]["engine"] for i in range(6)]
            assert answers == ["e0", "e1", "e2", "e0", "e1", "e2"]

    run(scenario)


def test_a_prompt_routed_moments_ago_goes_where_it_went_before_its_events(
    tmp_path: Path,
) -> None:
    """The fakes publish nothing unless told: the router's guess alone sends the repeat
    (a conversation's next turn, sent before the engine's events came) after it."""

    async def scenario() -> None:
        async with setup(tmp_path, n=3) as s:
            first = (await s.post())[1]["engine"]
            longer = [*PROMPT, *range(5000, 5000 + BLOCK)]  # the next turn: one more block
            assert (await s.post(prompt=longer))[1]["engine"] == first
            assert s.router.counters.by_reason.get("prefix") == 1

    run(scenario)


def test_a_rebuilt_index_keeps_the_prompts_routed_moments_ago(tmp_path: Path) -> None:
    """The subscriber rebuilds an engine's entries from its replay buffer (at the
    router's start, an engine back): a prompt routed meanwhile, its events not yet in
    the buffer, still draws its next turn."""

    async def scenario() -> None:
        async with setup(tmp_path, n=3) as s:
            first = (await s.post())[1]["engine"]
            state = s.router.engines[first]
            publisher = s.publishers[int(first[1:])]
            replays = publisher.replays
            assert state.subscriber is not None
            state.subscriber.resync()
            await until(lambda: publisher.replays > replays, "the rebuild")
            longer = [*PROMPT, *range(5000, 5000 + BLOCK)]
            assert (await s.post(prompt=longer))[1]["engine"] == first

    run(scenario)


def test_round_robin_ignores_the_index(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path, policy="round-robin") as s:
            s.publishers[1].publish([stored(HASHES)])
            await until(lambda: s.router.index.held_blocks("e1") == 4, "e1's blocks")
            answers = [(await s.post())[1]["engine"] for _ in range(4)]
            assert answers == ["e0", "e1", "e0", "e1"]

    run(scenario)


def test_streams_pass_through(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path, events=False) as s:
            status, text = await s.post(
                "/v1/chat/completions",
                stream=True,
                prompt=None,
                messages=[{"role": "user", "content": "hi"}],
            )
            assert status == 200
            assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
            # no model directory: routed cold, counted, not refused
            assert s.router.counters.prompt_errors == 1

    run(scenario)


def test_a_dead_engine_is_taken_out_and_put_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path, health_interval_s=3600) as s:
            s.publishers[0].publish([stored(HASHES)])
            await until(lambda: s.router.index.held_blocks("e0") == 4, "e0's blocks")
            port = s.engines[0].port
            await s.engines[0].stop()
            status, answer = await s.post()  # e0 holds the prefix but refuses: e1 answers
            assert (status, answer["engine"]) == (200, "e1")
            state = s.router.engines["e0"]
            assert not state.up and state.failures == 1
            assert s.router.index.held_blocks("e0") == 0  # its entries went with it
            s.engines[0].port = port
            await s.engines[0].start()
            await s.router._check(state)  # the health check finds it again
            assert state.up
            # and its entries come back from the publisher's replay buffer
            await until(lambda: s.router.index.held_blocks("e0") == 4, "e0's replayed blocks")
            _, answer = await s.post()
            assert answer["engine"] == "e0"

    run(scenario)


def test_a_dropped_connection_is_tried_once_more_before_the_engine_is_taken_out(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with setup(tmp_path, health_interval_s=3600) as s:
            s.publishers[0].publish([stored(HASHES)])
            await until(lambda: s.router.index.held_blocks("e0") == 4, "e0's blocks")
            s.engines[0].drops = 1
            _, answer = await s.post()
            assert answer["engine"] == "e0" and s.router.engines["e0"].up
            s.engines[0].drops = 2
            _, answer = await s.post()
            assert answer["engine"] == "e1" and not s.router.engines["e0"].up

    run(scenario)


def test_a_hanging_engine_is_taken_out(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path, request_timeout_s=0.3, health_interval_s=3600) as s:
            s.engines[0].mode = "hang"
            answers = [(await s.post())[1]["engine"] for _ in range(3)]
            assert answers == ["e1", "e1", "e1"]
            assert s.router.engines["e0"].taken_out == 1
            assert s.router.counters.retries == 1

    run(scenario)


def test_failing_health_takes_out_passing_health_puts_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path) as s:
            s.engines[1].mode = "sick"
            await until(lambda: not s.router.engines["e1"].up, "e1 taken out")
            assert {(await s.post(prompt=cold(i)))[1]["engine"] for i in range(4)} == {"e0"}
            s.engines[1].mode = "ok"
            await until(lambda: s.router.engines["e1"].up, "e1 put back")
            engines = {(await s.post(prompt=cold(i)))[1]["engine"] for i in range(4, 8)}
            assert engines == {"e0", "e1"}

    run(scenario)


def test_every_engine_down_is_a_503(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path, events=False, health_interval_s=3600) as s:
            for engine in s.engines:
                await engine.stop()
            status, answer = await s.post()
            assert status == 503 and "no engine" in answer["error"]["message"]
            assert s.router.counters.unanswered == 1

    run(scenario)


def test_malformed_events_are_counted_and_skipped(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path) as s:
            pub = s.publishers[0]
            counters = s.router.engines["e0"].subscriber.counters  # type: ignore[union-attr]
            before = counters.batches
            pub.publish([], payload=b"\xc1 not msgpack")
            bad = stored(HASHES[:1], medium="TAPE")  # a medium nobody knows
            pub.publish([bad, stored(HASHES[:2])])
            await until(lambda: counters.batches == before + 2, "both batches")
            assert counters.malformed == 2
            assert s.router.index.held_blocks("e0") == 2

    run(scenario)


async def with_a_gap(s: Setup) -> tuple[FakePublisher, BlockIndex, EventCounters]:
    """Once e0's start-up replay is in: a batch lost on the way, then one that arrives."""
    pub, index = s.publishers[0], s.router.index
    counters = s.router.engines["e0"].subscriber.counters  # type: ignore[union-attr]
    await until(lambda: pub.replays >= 1, "the start-up replay")
    pub.publish([stored(HASHES[:1])], send=False)  # lost on the way
    pub.publish([stored(HASHES[1:2])])
    return pub, index, counters


def test_missed_batches_are_replayed_and_a_restart_drops_the_engine(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path) as s:
            pub, index, counters = await with_a_gap(s)
            await until(lambda: index.held_blocks("e0") == 2, "the gap filled")
            assert counters.missed == 0 and counters.replayed >= 1
            pub.publish([removed(HASHES[:1])])
            await until(lambda: index.held_blocks("e0") == 1, "the removal")
            pub.restart()  # a new engine: numbering starts over
            pub.publish([stored(HASHES[3:4])])
            await until(lambda: counters.restarts == 1, "the restart")
            await until(lambda: index.best_tier("e0", HASHES[3]) is Tier.GPU, "the new block")
            assert index.best_tier("e0", HASHES[1]) is None  # the old process's block

    run(scenario)


def test_batches_a_replay_brought_that_still_arrive_live_are_no_restart(tmp_path: Path) -> None:
    """A gap's replay answers every buffered batch from the one asked for, the newer
    ones too (published while the subscriber was behind), and those still arrive live
    after it: a number lower than expected, but the same bytes. Taken for a restart
    they dropped the engine's entries (the router flake of stops 41, 51 and 55)."""

    async def scenario() -> None:
        async with setup(tmp_path) as s:
            pub, index, counters = await with_a_gap(s)  # its live batch asks the replay
            pub.publish([stored(HASHES[2:3])])  # buffered before the replay: in it, and live
            await until(lambda: index.held_blocks("e0") == 3, "the three blocks")
            pub.publish([stored(HASHES[3:4])])  # after the live copy, in order
            await until(lambda: index.held_blocks("e0") == 4, "the fourth block")
            assert counters.restarts == 0 and counters.missed == 0

    run(scenario)


def test_a_replay_that_stalls_is_asked_again(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path, replay_timeout_s=0.2) as s:
            pub, index = s.publishers[0], s.router.index
            counters = s.router.engines["e0"].subscriber.counters  # type: ignore[union-attr]
            await until(lambda: pub.replays >= 1, "the start-up replay")
            pub.ignore_replays = 1  # the engine's publisher too busy to answer once
            pub.publish([stored(HASHES[:1])], send=False)  # lost on the way
            pub.publish([stored(HASHES[1:2])])
            await until(lambda: index.held_blocks("e0") == 2, "the gap filled")
            assert counters.missed == 0 and pub.replays >= 3

    run(scenario)


def test_a_new_router_rebuilds_its_index(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path) as s:
            s.publishers[1].publish([stored(HASHES)])
            await until(lambda: s.router.index.held_blocks("e1") == 4, "e1's blocks")
            fresh = Router(s.router.config)
            await fresh.start()
            try:
                await until(lambda: fresh.index.held_blocks("e1") == 4, "the rebuilt index")
            finally:
                await fresh.stop()

    run(scenario)


def test_metrics_and_health(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path) as s:
            await s.post()
            async with s.session.get(s.base + "/metrics") as r:
                text = await r.text()
            assert r.headers["Content-Type"].startswith("text/plain; version=")
            assert "kvtier_router_requests_total 1.0" in text
            assert 'kvtier_router_engine_up{engine="e0"} 1.0' in text
            assert 'kvtier_router_events_malformed_total{engine="e1"} 0.0' in text
            async with s.session.get(s.base + "/health") as r:
                assert r.status == 200 and (await r.json())["engines"] == {"e0": True, "e1": True}
            async with s.session.get(s.base + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "fake"

    run(scenario)


def test_bad_bodies_are_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with setup(tmp_path, events=False) as s:
            url = s.base + "/v1/completions"
            for data in (b"{nope", b"[1, 2]"):
                async with s.session.post(url, data=data) as r:
                    assert r.status == 400

    run(scenario)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engines": ()}, "at least one engine"),
        ({"policy": "random"}, "unknown routing policy"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"engines": (EngineSpec("http://127.0.0.1:1"),)}
    with pytest.raises(ValueError, match=message):
        RouterConfig(**(base | kwargs))


def test_bad_engine_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="http"):
        EngineSpec("127.0.0.1:8000")
    with pytest.raises(ValueError, match="tcp:// or ipc://"):
        EngineSpec("http://h:1", events="udp://x")
    with pytest.raises(ValueError, match="unique"):
        RouterConfig((EngineSpec("http://h:1"), EngineSpec("http://h:1/")))
