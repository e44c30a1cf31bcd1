"""Load or recompute, per request and per tier, with real components: kvtier's scheduler
side and worker as `KvtierConnector` builds them, and a real redis-server behind the
shaping proxy (kvtier.remote.shaping_proxy). The recompute cost is given to the model as
engine steps would give it; the Redis costs are what the proxy makes them, measured."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvtier.connector import cost_model
from kvtier.connector.cost_model import CostConfig
from kvtier.remote.shaping_proxy import LinkProfile, ShapingProxy
from tests.remote.conftest import RedisServer, serve_redis
from tests.remote.test_head_keys import calls
from tests.vllm.test_offloading_spec import BLOCK_BYTES, TOKENS, Engine, engines, keys_of

with_engines = engines  # the fixture, under this module's name too

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext  # noqa: E402

from kvtier.offload.tier_metrics import METRICS  # noqa: E402
from kvtier.vllm.offloading.prompt_keys import PromptChain  # noqa: E402

SLOW = 0.2  # seconds added to each Redis round trip by the proxy


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis_proxy(tmp_path: Path) -> Iterator[tuple[RedisServer, ShapingProxy]]:
    servers = serve_redis(tmp_path)
    server = next(servers)
    try:
        with ShapingProxy(("127.0.0.1", server.port)) as proxy:
            yield server, proxy
    finally:
        next(servers, None)


def scan(engine: Engine, keys: list[bytes], ctx: ReqContext) -> int | None:
    """vLLM's prefix lookup: hits until the first miss; None if any answer was deferred."""
    hits, deferred = 0, False
    for key in keys:
        result = engine.manager.lookup(key, ctx)
        if result is LookupResult.MISS:
            break
        if result is LookupResult.RETRY:
            deferred = True
        else:
            hits += 1
    return None if deferred else hits


def settle(engine: Engine, keys: list[bytes], ctx: ReqContext) -> int:
    """Scan step after step (vLLM asks a deferred request again each step) until final."""
    for _ in range(20):
        found = scan(engine, keys, ctx)
        if found is not None:
            return found
        assert engine.manager.wait_lookups(timeout=30)
    raise AssertionError("the lookups never settled")


def recompute_per_block(engine: Engine, seconds: float) -> None:
    """What the engine's steps say recomputing costs (many steps: the average is there)."""
    cost = engine.manager.cost
    assert cost is not None
    for _ in range(60):
        cost.observe_step(TOKENS * 4, 4 * seconds)


def writer_and_reader(
    engines: list[Engine], server: RedisServer, proxy: ShapingProxy, **reader: Any
) -> tuple[Engine, Engine, list[bytes]]:
    """The writer stores 8 blocks in Redis (two prompts of 4); the reader reaches Redis
    through the proxy."""
    writer = Engine({"cpu_bytes_to_use": 8 * BLOCK_BYTES, "redis_url": server.url})
    engines.append(writer)
    keys = keys_of(8, start=500)
    writer.compute(list(range(8)), seed=3)
    writer.store(keys, list(range(8)))
    extra = {"cpu_bytes_to_use": 8 * BLOCK_BYTES, "redis_url": proxy.url} | reader
    engine = Engine(extra)
    engines.append(engine)
    return writer, engine, keys


def decided(engine: Engine, decision: str) -> float:
    stats = engine.manager.get_stats()
    values = stats.data["data"].get(METRICS[f"decided_{decision}_blocks"].name, {})
    return float(sum(v for labels, v in values.items() if labels == ("redis",)))


def test_a_returning_prompt_is_loaded_where_redis_beats_recompute_and_recomputed_where_not(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    server, proxy = redis_proxy
    _, reader, keys = writer_and_reader(engines, server, proxy)
    recompute_per_block(reader, 10.0)  # a big model: a block takes 10 s to recompute
    assert settle(reader, keys[:4], ReqContext(req_id="fast-link")) == 4
    assert decided(reader, "load") == 4

    proxy.reshape(LinkProfile.round_trip(SLOW))
    recompute_per_block(reader, 0.001)  # a tiny model: 1 ms a block
    assert settle(reader, keys[4:], ReqContext(req_id="slow-link")) == 0
    assert decided(reader, "recompute") == 4
    gauges = reader.manager.get_stats().data["data"]
    # one slow round trip moved the moving average by its weight, at least
    weight = CostConfig().smoothing
    assert gauges[METRICS["cost_round_trip_seconds"].name][("redis",)] >= SLOW * weight
    assert gauges[METRICS["cost_recompute_block_seconds"].name][("engine",)] < 0.01


def test_a_long_prefix_takes_its_head_from_the_cpu_tier_and_recomputes_the_slow_tail(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    server, proxy = redis_proxy
    _, reader, all_keys = writer_and_reader(engines, server, proxy)
    keys = all_keys[:4]
    reader.compute([0, 1], seed=3)
    reader.store(keys[:2], [0, 1])  # the head is in the reader's own CPU tier
    proxy.reshape(LinkProfile.round_trip(SLOW))
    recompute_per_block(reader, 0.001)
    assert settle(reader, keys, ReqContext(req_id="head-and-tail")) == 2


def test_the_loads_it_offers_are_served_and_measured(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    server, proxy = redis_proxy
    writer, reader, all_keys = writer_and_reader(engines, server, proxy)
    keys = all_keys[:4]
    recompute_per_block(reader, 10.0)
    ctx = ReqContext(req_id="load")
    assert settle(reader, keys, ctx) == 4
    reader.ctx = ctx
    errors, _ = reader.load(keys, [8, 9, 10, 11])
    assert not errors
    assert [reader.block_bytes(i) for i in (8, 9, 10, 11)] == [
        writer.block_bytes(i) for i in range(4)
    ]
    gauges = reader.manager.get_stats().data["data"]
    assert (("redis",)) in gauges[METRICS["cost_load_block_seconds"].name]


def test_a_lookup_in_flight_holds_the_request_no_longer_than_it_could_save(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    server, proxy = redis_proxy
    # long timeouts: the lookup stays in flight through the stall (no failure, no breaker)
    _, reader, all_keys = writer_and_reader(engines, server, proxy, redis_socket_timeout_s=60.0)
    keys = all_keys[:4]
    clock = FakeClock()
    reader.manager.clock = clock
    recompute_per_block(reader, 0.1)  # the 4 blocks could save at most 0.4 s
    proxy.stall()
    try:
        ctx = ReqContext(req_id="stalled")
        assert scan(reader, keys, ctx) is None  # asked: deferred
        assert scan(reader, keys, ctx) is None  # still within what it could save
        clock.now += 0.5
        assert scan(reader, keys, ctx) == 0  # waited long enough: recompute
        assert decided(reader, "recompute") == 4
    finally:
        proxy.resume()
    # the questions stayed asked: their answers serve the next request at once, with no
    # round trip of its own
    assert reader.manager.wait_lookups(timeout=30)
    recompute_per_block(reader, 10.0)
    assert scan(reader, keys, ReqContext(req_id="later")) == 4


class WorkerClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_load_from_a_stalled_redis_is_given_up_at_its_deadline(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    """Redis stops answering in the middle of a load: at the deadline (what recomputing
    the blocks costs) the worker reports them failed, vLLM recomputes them, and the late
    answer never reaches the engine's blocks."""
    server, proxy = redis_proxy
    _, reader, all_keys = writer_and_reader(engines, server, proxy, redis_socket_timeout_s=60.0)
    keys = all_keys[:2]
    recompute_per_block(reader, 0.5)
    ctx = ReqContext(req_id="stalled-load")
    assert settle(reader, keys, ctx) == 2
    spec = reader.manager.prepare_load(keys, ctx)
    assert spec.deadline_s == pytest.approx(1.0)  # two blocks' recompute
    clock = WorkerClock()
    reader.worker.clock = clock
    proxy.stall()
    try:
        reader.worker.submit_load(5, spec, GPULoadStoreSpec([8, 9], [2], [0]))
        assert reader.worker.get_finished() == []  # in flight, before its deadline
        clock.now += 1.1
        (result,) = reader.worker.get_finished()
        assert (result.job_id, result.success) == (5, True)  # done: as a failed load
        assert reader.worker.take_load_errors() == {8, 9}  # vLLM recomputes them
        report = reader.worker.take_report()
        assert report.expired_loads == {"redis": 2}
        assert report.failed_loads == [[k[:-4] for k in keys]]
        reader.manager.apply_worker_report(report)
        reader.manager.complete_load(set(keys), ctx)
    finally:
        proxy.resume()
    reader.worker.workers["remote"].close()  # the late answer has come and gone
    assert reader.block_bytes(8) == reader.block_bytes(9) == bytes(BLOCK_BYTES)
    stats = reader.manager.get_stats().data["data"]
    assert stats[METRICS["load_expired_blocks"].name] == {("redis",): 2}
    # the request, rescheduled by vLLM, asks again: its failed blocks now miss
    assert reader.manager.lookup(keys[0], ctx) is LookupResult.MISS


def test_a_load_is_timed_from_when_its_tier_took_it_and_kept_if_done_in_time_to_poll(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    """Two loads from a stalled Redis: the second waits in the queue behind the first,
    so only the first's time teaches the estimate (a queue on a busy engine is not the
    tier's slowness). A load that finished past its deadline before the worker looked
    has its blocks in place: it is kept, not given up and recomputed."""
    server, proxy = redis_proxy
    _, reader, all_keys = writer_and_reader(engines, server, proxy, redis_socket_timeout_s=60.0)
    recompute_per_block(reader, 0.5)
    first, second, late = (ReqContext(req_id=r) for r in ("first", "second", "late"))
    assert settle(reader, all_keys[:2], first) == 2
    assert settle(reader, all_keys[2:4], second) == 2
    assert settle(reader, all_keys[4:6], late) == 2
    clock = WorkerClock()
    reader.worker.clock = clock
    remote = reader.worker.workers["remote"]
    entered, load, subs, submit = threading.Event(), remote.handler.load, [], remote.submit_load

    def entering(*args: Any, **kwargs: Any) -> int:
        entered.set()
        return load(*args, **kwargs)

    def submitting(sub: int, *args: Any) -> None:
        subs.append(sub)  # the Redis worker's own job ids
        submit(sub, *args)

    remote.handler.load = entering  # type: ignore[method-assign]
    remote.submit_load = submitting  # type: ignore[method-assign]
    proxy.stall()
    try:
        for job, keys, ctx, ids in ((5, 0, first, [8, 9]), (6, 2, second, [10, 11])):
            spec = reader.manager.prepare_load(all_keys[keys : keys + 2], ctx)
            reader.worker.submit_load(job, spec, GPULoadStoreSpec(ids, [2], [0]))
        assert entered.wait(timeout=60)  # the first is at the stalled link, the second queued
        assert remote.began(subs[0]) is not None and remote.began(subs[1]) is None
        clock.now += 1.1
        assert sorted(r.job_id for r in reader.worker.get_finished()) == [5, 6]
        report = reader.worker.take_report()
        assert report.expired_loads == {"redis": 4}
        ((tier, blocks, took),) = report.loads  # the first's alone
        assert (tier, blocks) == ("redis", 2) and 0.5 < took <= 1.0 + 1e-9
        assert reader.worker.take_load_errors() == {8, 9, 10, 11}  # vLLM recomputes them
        reader.manager.apply_worker_report(report)
        reader.manager.complete_load(set(all_keys[:2]), first)
        reader.manager.complete_load(set(all_keys[2:4]), second)
    finally:
        proxy.resume()
    spec = reader.manager.prepare_load(all_keys[4:6], late)
    reader.worker.submit_load(7, spec, GPULoadStoreSpec([12, 13], [2], [0]))
    assert remote.wait(subs[2:], timeout=60)  # done, and not looked at yet
    clock.now += 10.0  # past its deadline, but done before the worker looked
    results = reader.worker.get_finished()  # (its promotion into the CPU tier starts)
    reader.worker.wait_finished({7})
    results += reader.worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(7, True)]
    assert reader.worker.take_load_errors() == set()
    assert reader.worker.take_report().expired_loads == {}
    assert reader.block_bytes(12) != bytes(BLOCK_BYTES)


def told_prompt(
    engine: Engine, keys: list[bytes], req_id: str, with_keys: bool = False
) -> ReqContext:
    """A request as `KvtierConnector` hands it over: its length told to the manager (and
    `with_keys`, its keys, as the connector reads them from vLLM's block hashes), and
    each key's end token recorded (as vLLM's scheduler records them)."""
    ctx = ReqContext(req_id=req_id)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * TOKENS)
    chain = PromptChain([k[:-4] for k in keys], 1, 0) if with_keys else None
    engine.manager.note_prompt(req_id, len(keys) * TOKENS, chain)
    return ctx


def wait_in_place(engine: Engine, seconds: float) -> None:
    cost = engine.manager.cost
    assert cost is not None
    cost.config = replace(cost.config, sync_wait_s=seconds)


def test_a_cold_prompt_is_answered_in_its_first_pass_where_redis_answers_in_time(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    """vLLM defers a request whose lookup is not answered yet by a whole step; a fast
    tier's answer is waited for in place instead (here with a bound long enough for any
    machine: the wait ends when the answer comes)."""
    server, proxy = redis_proxy
    _, reader, keys = writer_and_reader(engines, server, proxy)
    recompute_per_block(reader, 10.0)
    wait_in_place(reader, 30.0)
    cold = keys_of(6, start=9000)
    assert scan(reader, cold, told_prompt(reader, cold, "cold")) == 0  # final, not deferred
    # a returning prompt: its first key's hit is known in place, the rest are asked in one
    # round trip while the request waits a step, and the run is loaded whole
    ctx = told_prompt(reader, keys[:4], "returning")
    assert scan(reader, keys[:4], ctx) is None
    assert settle(reader, keys[:4], ctx) == 4
    # not told the prompt's length (another connector): the first pass defers, as before
    assert scan(reader, cold[:3], ReqContext(req_id="untold")) is None
    assert reader.manager.wait_lookups(timeout=30)  # none left in flight at teardown


def test_a_slow_redis_is_not_waited_for_once_its_round_trips_are_known(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    server, proxy = redis_proxy
    _, reader, keys = writer_and_reader(engines, server, proxy)
    proxy.reshape(LinkProfile.round_trip(SLOW))
    recompute_per_block(reader, 0.001)  # 4 blocks save at most 4 ms: less than a trip
    wait_in_place(reader, 30.0)  # a slow tier is not waited for in place either
    assert settle(reader, keys[:2], ReqContext(req_id="first")) == 0  # measures the trips
    assert decided(reader, "recompute") == 2  # (the counts are since the last scrape)
    # neither deferred nor waited on: final in the first pass
    told = told_prompt(reader, keys[4:], "told")
    assert scan(reader, keys[4:], told) == 0
    assert decided(reader, "recompute") == 4
    # asked again on later steps (as vLLM asks a request it cannot schedule yet): its
    # blocks were decided already, and each counts once
    for _ in range(3):
        assert scan(reader, keys[4:], told) == 0
    assert decided(reader, "recompute") == 0
    assert reader.manager.wait_lookups(timeout=30)  # none left in flight at teardown


def test_the_answers_of_requests_that_went_on_without_them_still_count(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    """The hit share (how long a request may wait, see `CostModel.wait_budget_s`) learns
    from the requests that did not wait too: otherwise a share that fell would never
    rise again."""
    server, proxy = redis_proxy
    _, reader, keys = writer_and_reader(engines, server, proxy)
    cost = reader.manager.cost
    assert cost is not None
    proxy.reshape(LinkProfile.round_trip(SLOW))
    recompute_per_block(reader, 0.001)
    assert settle(reader, keys[:1], ReqContext(req_id="measure")) == 0  # a hit, too slow
    assert cost.hit_share("redis") == 1.0
    new = keys_of(3, start=8000)
    assert scan(reader, new, told_prompt(reader, new, "went-on")) == 0  # did not wait
    assert cost.hit_share("redis") == 1.0  # its answer is not in yet
    assert reader.manager.wait_lookups(timeout=30)
    other = keys_of(3, start=8100)
    assert scan(reader, other, told_prompt(reader, other, "next")) == 0
    assert cost.hit_share("redis") == pytest.approx(1 - CostConfig().smoothing)  # one miss
    assert reader.manager.wait_lookups(timeout=30)  # none left in flight at teardown


def test_a_prompts_lookups_take_one_round_trip_held_for_its_walk(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    """vLLM walks a prompt's keys in one call; the connector holds their Redis questions
    until the walk ends, so they share one round trip (the first went out alone, and the
    rest a round trip later: 0.4 s before a hit was known through a link adding 0.2 s)."""
    server, proxy = redis_proxy
    _, reader, all_keys = writer_and_reader(engines, server, proxy)
    recompute_per_block(reader, 10.0)
    remote = reader.manager.remote
    proxy.reshape(LinkProfile.round_trip(SLOW))  # a first question sent alone stays out
    remote.take_lookup_seconds()
    ctx = ReqContext(req_id="held")
    with reader.manager.held_lookups():
        assert scan(reader, all_keys[:4], ctx) is None
    assert reader.manager.wait_lookups(timeout=30)
    assert len(remote.take_lookup_seconds()) == 1  # one round trip, every key in it
    assert scan(reader, all_keys[:4], ctx) == 4


def test_a_run_its_lookup_carried_is_waited_for_and_loaded_without_a_round_trip(
    engines: list[Engine],
    redis_proxy: tuple[RedisServer, ShapingProxy],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through a link adding 0.2 s, a 4-block prompt that recomputes in 0.28 s: a lookup
    and then a load (0.4 s) lose to recomputing, and the request does not wait; where the
    lookup carries the blocks (`kvtier.remote.prefetch`: the scheduler and the worker in
    one process, as an engine of one worker runs), it is waited for (0.21 s, inside the
    margin, `cost_model.WAIT_MARGIN`) and its load reads nothing from Redis."""
    server, proxy = redis_proxy
    writer, reader, keys = writer_and_reader(engines, server, proxy)
    cost = reader.manager.cost
    assert cost is not None
    proxy.reshape(LinkProfile.round_trip(SLOW))
    for _ in range(40):  # what the round trips and a load through the link measure
        cost.observe_round_trip("redis", SLOW)
    cost.observe_load("redis", 4, SLOW + 4 * 0.002)
    recompute_per_block(reader, 0.07)
    monkeypatch.setattr(cost_model, "PREFETCH_SHARE", 0.0)  # lookups carry nothing
    assert cost.prefetch_blocks("redis") == 0
    assert settle(reader, keys[:4], told_prompt(reader, keys[:4], "headers")) == 0
    assert decided(reader, "recompute") == 4
    monkeypatch.undo()
    assert cost.prefetch_blocks("redis") == 50
    ctx = told_prompt(reader, keys[4:], "carried")
    with reader.manager.held_lookups():
        assert scan(reader, keys[4:], ctx) is None  # waits for the answer
    assert settle(reader, keys[4:], ctx) == 4
    assert decided(reader, "load") == 4
    client = server.client()
    client.config_resetstat()
    reader.ctx = ctx
    errors, report = reader.load(keys[4:], [8, 9, 10, 11])
    assert not errors
    assert [reader.block_bytes(i) for i in (8, 9, 10, 11)] == [
        writer.block_bytes(i) for i in range(4, 8)
    ]
    assert calls(client) == {}  # no round trip: every block came with the lookup
    assert [blocks for tier, blocks, _ in report.loads if tier == "redis"] == [0]
    assert reader.manager.wait_lookups(timeout=30)  # none left in flight at teardown


def test_a_prompt_this_engine_stored_is_waited_for_after_a_run_of_new_ones(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    """Two hit shares: ten new prompts in a row (misses) stop the waiting for the next
    new one, not for a prompt whose blocks this engine stored in Redis itself (a
    conversation's next turn after a run of new conversations)."""
    _, proxy = redis_proxy
    reader = Engine({"cpu_bytes_to_use": 8 * BLOCK_BYTES, "redis_url": proxy.url})
    engines.append(reader)
    own, newer = keys_of(8, start=700), keys_of(8, start=800)
    reader.compute(list(range(8)), seed=4)
    reader.store(own, list(range(8)))
    reader.compute(list(range(8)), seed=5)
    reader.store(newer, list(range(8)))  # the CPU tier now holds only these
    assert reader.manager.local.lookup([k[:-4] for k in own]) == 0
    cost = reader.manager.cost
    assert cost is not None
    proxy.reshape(LinkProfile.round_trip(SLOW))
    for _ in range(40):
        cost.observe_round_trip("redis", SLOW)
    recompute_per_block(reader, 0.1)  # 8 blocks: 0.8 s, worth a 0.2 s wait at first
    for i in range(10):
        cold = keys_of(8, start=1000 + 10 * i)
        assert settle(reader, cold, told_prompt(reader, cold, f"new-{i}")) == 0
    assert cost.hit_share("redis") < 0.5 and cost.hit_share("redis", stored=True) == 1.0
    cold = keys_of(8, start=2000)
    assert scan(reader, cold, told_prompt(reader, cold, "new-last")) == 0  # no wait
    ctx = told_prompt(reader, own, "own")
    assert scan(reader, own, ctx) is None  # waits for Redis's answer
    assert settle(reader, own, ctx) == 8
    assert reader.manager.wait_lookups(timeout=30)  # none left in flight at teardown


def test_a_next_turn_waits_only_for_what_this_engine_stored(
    engines: list[Engine], redis_proxy: tuple[RedisServer, ShapingProxy]
) -> None:
    """A conversation's next turn: its history (2 blocks) is what this engine stored in
    Redis, its new part (6 blocks) is not. Through a link adding 0.2 s, with 0.1 s a
    block to recompute, a lookup that could bring all 8 blocks back is worth waiting for,
    the history alone is not (a round trip to load 0.2 s of recompute): told the
    prompt's keys, the request goes on at once; not told them (another connector), it
    waits for the answer, as before."""
    _, proxy = redis_proxy
    reader = Engine({"cpu_bytes_to_use": 8 * BLOCK_BYTES, "redis_url": proxy.url})
    engines.append(reader)
    told, untold, newer = keys_of(2, start=700), keys_of(2, start=710), keys_of(8, start=800)
    reader.compute([0, 1, 2, 3], seed=4)
    reader.store(told + untold, [0, 1, 2, 3])
    reader.compute(list(range(8)), seed=5)
    reader.store(newer, list(range(8)))  # the CPU tier now holds only these
    assert reader.manager.local.lookup([k[:-4] for k in told + untold]) == 0
    cost = reader.manager.cost
    assert cost is not None
    proxy.reshape(LinkProfile.round_trip(SLOW))
    for _ in range(40):
        cost.observe_round_trip("redis", SLOW)
    recompute_per_block(reader, 0.1)
    prompt = told + keys_of(6, start=900)
    assert scan(reader, prompt, told_prompt(reader, prompt, "told", with_keys=True)) == 0
    prompt = untold + keys_of(6, start=910)
    assert scan(reader, prompt, told_prompt(reader, prompt, "untold")) is None  # waits
    assert reader.manager.wait_lookups(timeout=30)  # none left in flight at teardown


def test_a_tier_whose_loads_look_too_slow_is_measured_again_by_a_probe_that_waits(
    engines: list[Engine],
    redis_proxy: tuple[RedisServer, ShapingProxy],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loads predicted slower than recomputing are not waited for, so nothing measured
    them again: an estimate raised by loads given up on a saturated engine (bench_serving's
    multi-turn at saturation) kept every later workload from loading. Every PROBE_EVERY-th
    such request waits and loads its run, and the estimate moves."""
    server, proxy = redis_proxy
    writer = Engine({"cpu_bytes_to_use": 8 * BLOCK_BYTES, "redis_url": server.url})
    engines.append(writer)
    prompts = [keys_of(2, start=3000 + 10 * i) for i in range(3)]
    writer.compute([0, 1], seed=8)
    for keys in prompts:
        writer.store(keys, [0, 1])
    reader = Engine({"cpu_bytes_to_use": 8 * BLOCK_BYTES, "redis_url": proxy.url})
    engines.append(reader)
    cost = reader.manager.cost
    assert cost is not None
    proxy.reshape(LinkProfile.round_trip(SLOW))
    for _ in range(40):
        cost.observe_round_trip("redis", SLOW)
    cost.observe_load("redis", 2, SLOW + 2 * 5.0)  # 5 s a block: loads given up
    recompute_per_block(reader, 0.06)
    monkeypatch.setattr(cost_model, "PREFETCH_SHARE", 0.0)  # the load is what measures
    monkeypatch.setattr(cost_model, "PROBE_EVERY", 3)
    for i, keys in enumerate(prompts[:2]):
        assert scan(reader, keys, told_prompt(reader, keys, f"gone-on-{i}")) == 0  # no wait
    keys = prompts[2]
    ctx = told_prompt(reader, keys, "probe")
    assert scan(reader, keys, ctx) is None  # the third waits
    assert settle(reader, keys, ctx) == 2
    reader.ctx = ctx
    errors, _ = reader.load(keys, [8, 9])
    assert not errors
    block_seconds = cost.tier("redis").block_seconds.value
    assert block_seconds is not None and block_seconds < 0.85 * 5.0  # measured again
    assert reader.manager.wait_lookups(timeout=30)  # none left in flight at teardown


def test_a_request_behind_a_stalled_round_trip_does_not_wait_its_whole_budget(
    engines: list[Engine],
    redis_proxy: tuple[RedisServer, ShapingProxy],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Round trips are measured when they end: a tier that stalls looks as fast as
    before until then. A request whose questions queue behind a round trip that has
    taken longer than a margin under what the lookup could save goes on without it;
    the request whose own round trip it is keeps its whole budget."""
    server, proxy = redis_proxy
    _, reader, keys = writer_and_reader(engines, server, proxy, redis_socket_timeout_s=60.0)
    assert settle(reader, keys[:1], ReqContext(req_id="measure")) == 1  # a fast round trip
    clock = FakeClock()
    reader.manager.clock = clock
    lookups = reader.manager.remote._async
    lookups._clock = clock  # the lookups' clock: the trips' ages
    sent = threading.Event()  # the lookup thread has started a round trip
    ask = lookups.store.try_count_prefixes

    def asked(*args: Any, **kwargs: Any) -> Any:
        sent.set()
        return ask(*args, **kwargs)

    monkeypatch.setattr(lookups.store, "try_count_prefixes", asked)
    recompute_per_block(reader, 0.1)  # 4 blocks could save 0.4 s
    proxy.stall()
    try:
        first = told_prompt(reader, keys[4:8], "first")
        assert scan(reader, keys[4:8], first) is None  # asked: its round trip stalls
        assert sent.wait(timeout=30)  # on its way (not merely queued with the next)
        clock.now += 0.35
        cold = keys_of(4, start=8200)
        assert scan(reader, cold, told_prompt(reader, cold, "later")) == 0  # behind it
        assert scan(reader, keys[4:8], first) is None  # its own trip: 0.35 s of 0.4
        clock.now += 0.1
        assert scan(reader, keys[4:8], first) == 0
    finally:
        proxy.resume()
    assert reader.manager.wait_lookups(timeout=30)  # none left in flight at teardown
