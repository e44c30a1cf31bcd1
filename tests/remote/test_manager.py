"""The remote offloading manager on a real server: scenarios and a model-based test."""

from __future__ import annotations

import gc
import threading
from collections.abc import Sequence
from typing import Any, cast

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvtier.offload.abstract import OffloadingEvent
from kvtier.remote.async_lookup import AsyncLookups
from kvtier.remote.breaker import BreakerConfig
from kvtier.remote.remote_manager import RemoteLoadStoreSpec, RemoteOffloadingManager
from kvtier.remote.tier import RemoteTier
from kvtier.types import BlockHash, int_block_hash
from tests.remote.conftest import FakeClock, RedisServer

FP = "model=tiny|dtype=fp16|block=16|format=1"
H = [int_block_hash(i) for i in range(10)]


def tier_for(server: RedisServer, clock: FakeClock | None = None) -> RemoteTier:
    return RemoteTier.from_url(
        server.url,
        FP,
        block_size=16,
        clock=clock or FakeClock(),
        breaker=BreakerConfig(failure_threshold=1, reset_timeout_s=5.0),
    )


def store_all(manager: RemoteOffloadingManager, hashes: list[BlockHash]) -> None:
    out = manager.prepare_store(hashes)
    assert out is not None
    manager.complete_store(out.block_hashes_to_store)


def test_store_lookup_load_cycle_with_events(redis_server: RedisServer) -> None:
    tier = tier_for(redis_server)
    manager = tier.manager(enable_events=True, synthetic_payload_bytes=256)
    assert manager.lookup(H) == 0
    out = manager.prepare_store(H[:4])
    assert out is not None and out.block_hashes_to_store == H[:4] and out.block_hashes_evicted == []
    assert isinstance(out.store_spec, RemoteLoadStoreSpec) and out.store_spec.medium() == "REMOTE"
    assert manager.lookup(H) == 0  # not readable before complete_store
    manager.complete_store(H[:4])
    assert manager.lookup(H) == 4
    spec = manager.prepare_load(H[:4])
    assert isinstance(spec, RemoteLoadStoreSpec) and spec.block_hashes == H[:4]
    manager.complete_load(H[:4])
    assert list(manager.take_events()) == [OffloadingEvent(H[:4], 16, "REMOTE", removed=False)]
    assert list(manager.take_events()) == []
    stats = tier.stats
    assert (stats.stored_bytes, stats.loaded_bytes) == (4 * 256, 4 * 256)
    tier.close()


def test_in_flight_stores_are_offered_once_and_failures_leave_nothing(
    redis_server: RedisServer,
) -> None:
    manager = tier_for(redis_server).manager(enable_events=True, synthetic_payload_bytes=64)
    first = manager.prepare_store(H[:3])
    second = manager.prepare_store(H[:5])
    assert first is not None and second is not None
    assert second.block_hashes_to_store == H[3:5]  # H[:3] already in flight here
    manager.complete_store(H[:3], success=False)
    manager.complete_store(H[3:5])
    assert manager.lookup(H[3:]) == 2 and manager.lookup(H) == 0
    assert [e.block_hashes for e in manager.take_events()] == [H[3:5]]
    assert manager.num_in_flight == (0, 0)


def test_repeated_hashes_store_once_and_load_once_per_listing(redis_server: RedisServer) -> None:
    manager = tier_for(redis_server).manager(enable_events=True, synthetic_payload_bytes=64)
    out = manager.prepare_store([H[0], H[1], H[0]])
    assert out is not None and out.block_hashes_to_store == H[:2]
    manager.complete_store([H[0], H[0], H[1]])
    assert [e.block_hashes for e in manager.take_events()] == [H[:2]]  # each once
    assert manager.num_in_flight == (0, 0)
    manager.prepare_store([H[2]])
    manager.complete_store([H[2], H[2]], success=False)
    assert manager.num_in_flight == (0, 0) and manager.lookup(H[:3]) == 2
    manager.prepare_load([H[0], H[0]])  # one load per listing, as vLLM
    assert manager.num_in_flight == (2, 0)
    with pytest.raises(KeyError, match="not being loaded"):
        manager.complete_load([H[0]] * 3)
    manager.complete_load([H[0], H[0]])
    assert manager.num_in_flight == (0, 0)


def test_caller_mistakes_are_refused_with_state_unchanged(redis_server: RedisServer) -> None:
    manager = tier_for(redis_server).manager()
    for call in (manager.prepare_store, manager.prepare_load, manager.complete_store):
        with pytest.raises(ValueError, match=r"must be bytes .* got 'abc'"):
            call([H[0], "abc"])  # type: ignore[operator]
    assert manager.num_in_flight == (0, 0)
    manager.prepare_load(H[:2])
    with pytest.raises(KeyError, match="not being loaded"):
        manager.complete_load(H[1:3])
    assert manager.num_in_flight == (2, 0)
    manager.complete_load(H[:2])
    with pytest.raises(KeyError, match="not being loaded"):
        manager.complete_load(H[:1])
    assert manager.num_in_flight == (0, 0)


def test_two_engines_share_and_tenants_do_not(redis_server: RedisServer) -> None:
    engine_a, engine_b = tier_for(redis_server), tier_for(redis_server)
    store_all(engine_a.manager(synthetic_payload_bytes=32), H[:6])
    assert engine_b.manager().lookup(H) == 6
    store_all(engine_a.manager("tenant-1", synthetic_payload_bytes=32), H[:3])
    assert engine_b.manager("tenant-1").lookup(H) == 3
    assert engine_b.manager("tenant-2").lookup(H) == 0


def test_open_breaker_offers_nothing_to_store(redis_server: RedisServer) -> None:
    clock = FakeClock()
    tier = tier_for(redis_server, clock)
    manager = tier.manager(synthetic_payload_bytes=32)
    redis_server.kill()
    assert manager.lookup(H) == 0  # fails, opens the breaker (threshold 1)
    out = manager.prepare_store(H[:4])
    assert out is not None and out.block_hashes_to_store == []  # no device copies wasted
    redis_server.start()
    clock.advance(5.0)
    store_all(manager, H[:4])  # the probe is the store itself
    assert manager.lookup(H) == 4
    tier.close()  # (its socket, left to the collector, warned in a later test)


def test_unknown_option_lists_the_known_ones(redis_server: RedisServer) -> None:
    with pytest.raises(ValueError, match=r"unknown remote tier options \['pasword'\].*password"):
        RemoteTier.from_url(redis_server.url, FP, block_size=16, pasword="x")


class RemoteManagerMachine(RuleBasedStateMachine):
    """Any interleaving of the calls, plus Redis evicting blocks, against a set model."""

    hashes = st.lists(st.sampled_from(H), min_size=1, max_size=5, unique=True)
    # the same with up to two hashes listed again, anywhere (vLLM accepts repeats)
    repeating = hashes.flatmap(
        lambda hs: st.lists(st.sampled_from(hs), max_size=2).flatmap(
            lambda more: st.permutations([*hs, *more])
        )
    )
    loads = Bundle("loads")

    def __init__(self, server: RedisServer) -> None:
        super().__init__()
        self.server = server
        self.client = server.client()
        self.client.flushall()
        self.tier = tier_for(server)
        self.manager = self.tier.manager(enable_events=True, synthetic_payload_bytes=16)
        self.stored: set[BlockHash] = set()
        self.storing: set[BlockHash] = set()
        self.stored_here: set[BlockHash] = set()  # by this engine, evicted or not

    def teardown(self) -> None:
        self.tier.close()
        self.client.close()

    @rule(hashes=hashes)
    def lookup(self, hashes: list[BlockHash]) -> None:
        expected = next((i for i, h in enumerate(hashes) if h not in self.stored), len(hashes))
        assert self.manager.lookup(hashes) == expected

    @rule(target=loads, hashes=repeating)
    def prepare_load(self, hashes: list[BlockHash]) -> list[BlockHash]:
        spec = self.manager.prepare_load(hashes)
        assert isinstance(spec, RemoteLoadStoreSpec) and spec.block_hashes == hashes
        return hashes

    @rule(hashes=consumes(loads))
    def complete_load(self, hashes: list[BlockHash]) -> None:
        self.manager.complete_load(hashes)

    @rule(hashes=repeating)
    def prepare_store(self, hashes: list[BlockHash]) -> None:
        out = self.manager.prepare_store(hashes)
        assert out is not None
        expected = [h for h in dict.fromkeys(hashes) if h not in self.storing]
        assert out.block_hashes_to_store == expected  # each hash once
        self.storing.update(hashes)

    @rule(hashes=repeating, success=st.booleans())
    def complete_store(self, hashes: list[BlockHash], success: bool) -> None:
        self.manager.complete_store(hashes, success)
        done = [h for h in dict.fromkeys(hashes) if h in self.storing]
        events = [e.block_hashes for e in self.manager.take_events()]
        assert events == ([done] if success and done else [])  # each stored hash once
        self.storing -= set(done)
        if success:
            self.stored |= set(done)
            self.stored_here |= set(done)

    @rule(block=st.sampled_from(H))
    def redis_evicts(self, block: BlockHash) -> None:
        self.client.delete(self.tier.store.key(block))
        self.stored.discard(block)

    @invariant()
    def nothing_unexpected_on_the_server(self) -> None:
        assert self.manager.num_in_flight[1] == len(self.storing)
        assert self.tier.stats.errors == 0

    @invariant()
    def it_knows_what_it_stored(self) -> None:
        assert {h for h in H if self.manager.stored_here(h)} == self.stored_here


def test_manager_against_model(redis_server: RedisServer) -> None:
    run_state_machine_as_test(
        lambda: RemoteManagerMachine(redis_server),
        settings=settings(max_examples=25, stateful_step_count=30, deadline=None),
    )


def test_async_lookup_answers_none_until_known(redis_server: RedisServer) -> None:
    with tier_for(redis_server) as tier:
        writer = tier.manager(synthetic_payload_bytes=32)
        store_all(writer, H[:4])
        manager = tier.manager(async_lookup=True)
        assert manager.lookup(H) is None  # asked: the scheduler moves on
        assert manager.wait_lookups(timeout=30)
        assert manager.lookup(H) == 4  # asked again: the answer
        assert manager.lookup(H) is None  # a fresh question after that
        assert manager.lookup(H[:2]) is None  # distinct prefixes are distinct questions
        assert manager.wait_lookups(timeout=30)
        assert (manager.lookup(H[:2]), manager.lookup(H)) == (2, 4)


def test_async_lookup_against_a_dead_server_answers_misses(redis_server: RedisServer) -> None:
    with tier_for(redis_server) as tier:
        manager = tier.manager(async_lookup=True)
        redis_server.kill()
        assert manager.lookup(H) is None
        assert manager.wait_lookups(timeout=30)
        assert manager.lookup(H) == 0
        assert tier.stats.errors == 1


def test_a_lookup_whose_round_trip_failed_is_asked_again_not_a_miss(
    redis_server: RedisServer,
) -> None:
    """A round trip that timed out (on a loaded machine the server or the lookup thread
    got no CPU for the socket timeout) says nothing about the blocks. Answered as a miss,
    a tensor-parallel engine loaded only the prefix before the block whose lookup timed
    out (32 or 128 of 192 tokens). The question is asked again instead."""
    tier = RemoteTier.from_url(
        redis_server.url, FP, block_size=16, clock=FakeClock(), socket_timeout_s=0.2
    )
    try:
        store_all(tier.manager(synthetic_payload_bytes=32), H[:4])
        manager = tier.manager(async_lookup=True)
        redis_server.pause()
        try:
            assert manager.lookup(H) is None
            assert manager.wait_lookups(timeout=30)  # its round trip timed out
        finally:
            redis_server.resume()
        assert tier.stats.errors == 1
        assert manager.lookup(H) is None  # no answer: asked again (it was a miss, 0)
        assert manager.wait_lookups(timeout=30)
        assert manager.lookup(H) == 4
    finally:
        tier.close()


def test_lookups_of_a_dead_server_are_misses_once_the_breaker_opens(
    redis_server: RedisServer,
) -> None:
    """Asking again is bounded: each failed round trip counts towards the breaker, and
    once it opens the tier is down and every answer is a miss."""
    threshold = 3
    tier = RemoteTier.from_url(
        redis_server.url,
        FP,
        block_size=16,
        clock=FakeClock(),
        breaker=BreakerConfig(failure_threshold=threshold, reset_timeout_s=5.0),
    )
    try:
        manager = tier.manager(async_lookup=True)
        redis_server.kill()
        answers = []
        for _ in range(threshold):
            answers.append(manager.lookup(H))
            assert manager.wait_lookups(timeout=30)
        assert answers == [None] * threshold
        assert manager.lookup(H) == 0  # the third failure opened the breaker
        assert tier.stats.errors == threshold
        assert manager.lookup(H[:2]) is None  # while it is open: asked, and refused
        assert manager.wait_lookups(timeout=30)
        assert manager.lookup(H[:2]) == 0
        assert tier.stats.errors == threshold
    finally:
        tier.close()


def test_async_questions_are_bounded_oldest_forgotten_first(redis_server: RedisServer) -> None:
    with tier_for(redis_server) as tier:
        store_all(tier.manager(synthetic_payload_bytes=8), H[:3])
        lookups = AsyncLookups(tier.store, None, max_pending=1)
        assert lookups.lookup(H[:1]) is None
        assert lookups.lookup(H[:2]) is None  # forgets the H[:1] question
        assert lookups.wait(timeout=30)
        assert lookups.lookup(H[:1]) is None  # asked anew
        assert lookups.wait(timeout=30)
        assert lookups.lookup(H[:1]) == 1
        lookups.close()
        with pytest.raises(ValueError, match="max_pending must be >= 1"):
            AsyncLookups(tier.store, None, max_pending=0)


class _BlockingStore:
    """A `try_count_prefixes` that holds the lookup thread until released, recording the
    length of each question of each call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def try_count_prefixes(
        self, questions: Sequence[Sequence[BlockHash]], salt: str | None, fetch: int = 0
    ) -> list[int]:
        self.calls.append([len(q) for q in questions])
        self.started.set()
        assert self.release.wait(timeout=30)
        return [0] * len(questions)


def test_forgotten_questions_are_not_sent() -> None:
    store = _BlockingStore()
    lookups = AsyncLookups(cast(Any, store), None, max_pending=1)
    try:
        assert lookups.lookup(H[:1]) is None
        assert store.started.wait(timeout=30)  # H[:1] is running: it cannot be withdrawn
        assert lookups.lookup(H[:2]) is None  # queued behind it, forgets H[:1]
        assert lookups.lookup(H[:3]) is None  # forgets H[:2] before it was sent
        store.release.set()
        assert lookups.wait(timeout=30)
        assert store.calls == [[1], [3]]
    finally:
        store.release.set()
        lookups.close()


def test_questions_asked_during_a_round_trip_share_the_next_one() -> None:
    """vLLM asks block by block: a 4,096-token prompt is 128 questions in one step, which
    one round trip each made wait on each other."""
    store = _BlockingStore()
    lookups = AsyncLookups(cast(Any, store), None)
    try:
        assert lookups.lookup(H[:1]) is None
        assert store.started.wait(timeout=30)  # its round trip holds the thread
        assert [lookups.lookup([h]) for h in H[1:4]] == [None] * 3
        store.release.set()
        assert lookups.wait(timeout=30)
        assert store.calls == [[1], [1, 1, 1]]
        assert [lookups.lookup([h]) for h in H[:4]] == [0, 0, 0, 0]
    finally:
        store.release.set()
        lookups.close()


def test_the_round_trip_on_its_way_is_numbered_and_aged_until_it_ends() -> None:
    """A question asked during a round trip waits for it to end: its age is a floor on
    what the tier's round trips take now (`CostModel.lookup_too_slow`'s `behind_s`)."""
    store = _BlockingStore()
    now = [10.0]
    lookups = AsyncLookups(cast(Any, store), None, clock=lambda: now[0])
    try:
        assert lookups.in_flight() is None
        assert lookups.lookup(H[:1]) is None
        assert store.started.wait(timeout=30)
        now[0] += 1.5
        assert lookups.in_flight() == (1, 1.5)
        store.release.set()
        assert lookups.wait(timeout=30)
        assert lookups.in_flight() is None  # ended before its answers were handed out
        store.started.clear()
        store.release.clear()
        assert lookups.lookup(H[:2]) is None
        assert store.started.wait(timeout=30)
        assert lookups.in_flight() == (2, 0.0)  # the next one, numbered on
    finally:
        store.release.set()
        lookups.close()


def test_questions_held_go_out_together_when_the_hold_ends() -> None:
    """One request's walk: its first question would go out alone and the rest of the
    prompt a round trip later (two round trips before a slow Redis's hit is known)."""
    store = _BlockingStore()
    store.release.set()
    lookups = AsyncLookups(cast(Any, store), None)
    try:
        with lookups.held():
            assert [lookups.lookup([h]) for h in H[:3]] == [None] * 3
            with lookups.held():  # nested: sent only when the outer one ends
                assert lookups.lookup(H[3:4]) is None
            assert not store.started.is_set()  # nothing sent while held
        assert lookups.wait(timeout=30)
        assert store.calls == [[1, 1, 1, 1]]
        with lookups.held():  # someone waiting for an answer: what is held goes now
            assert lookups.lookup(H[4:5]) is None
            assert lookups.wait(timeout=30)
            assert lookups.lookup(H[4:5]) == 0
        assert store.calls == [[1, 1, 1, 1], [1]]
    finally:
        lookups.close()


class _CountingStore:
    """A `try_count_prefixes` that answers each question with `answer` and counts calls."""

    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.calls = 0

    def try_count_prefixes(
        self, questions: Sequence[Sequence[BlockHash]], salt: str | None, fetch: int = 0
    ) -> list[int]:
        self.calls += 1
        return [self.answer] * len(questions)


def test_an_answer_left_uncollected_is_asked_again_not_handed_out_stale() -> None:
    """A request that asked and went away leaves an answer; the blocks may have been
    stored or evicted since, so a later asker of the same prefix gets a fresh one."""
    now = [0.0]
    store = _CountingStore(answer=0)
    lookups = AsyncLookups(cast(Any, store), None, max_age_s=2.0, clock=lambda: now[0])
    try:
        assert lookups.lookup(H[:3]) is None
        assert lookups.wait(timeout=30)
        assert lookups.lookup(H[:3]) == 0  # collected in time: the answer
        assert lookups.lookup(H[:3]) is None  # a new question
        assert lookups.wait(timeout=30)
        store.answer = 3  # the blocks were stored meanwhile
        now[0] = 2.5  # ... and the answer waited longer than max_age_s
        assert lookups.lookup(H[:3]) is None  # asked again
        assert lookups.wait(timeout=30)
        assert lookups.lookup(H[:3]) == 3
        assert store.calls == 3
        with pytest.raises(ValueError, match="max_age_s must be > 0 seconds, got 0"):
            AsyncLookups(cast(Any, store), None, max_age_s=0)
    finally:
        lookups.close()


def test_the_tier_holds_dropped_managers_weakly_and_closes_the_live_ones(
    redis_server: RedisServer,
) -> None:
    tier = tier_for(redis_server)
    for tenant in range(50):  # a service that makes a manager per tenant, then drops it
        tier.manager(salt=f"tenant-{tenant}")
    live = tier.manager(async_lookup=True)
    assert live.lookup(H) is None and live.wait_lookups(timeout=30)
    gc.collect()
    assert list(tier._managers) == [live]  # the dropped ones are not kept alive
    tier.close()
    threads = live._async._executor._threads  # type: ignore[union-attr]
    assert threads and not any(t.is_alive() for t in threads)  # its lookup thread stopped


def test_a_reset_moves_to_a_key_epoch_that_peers_share_once_they_reset(
    redis_server: RedisServer,
) -> None:
    from kvtier.remote.remote_manager import epoch_salt

    tier = tier_for(redis_server)
    try:
        engine, peer = (tier.manager(synthetic_payload_bytes=64) for _ in range(2))
        store_all(engine, H[:3])
        assert engine.reset_cache(epoch_salt(1)) == []  # Redis keeps no table to list
        assert engine.lookup(H[:3]) == 0  # the keys of before are never read again
        assert peer.lookup(H[:3]) == 3  # a peer that did not reset still reads them
        store_all(engine, H[5:7])
        assert peer.lookup(H[5:7]) == 0
        peer.reset_cache(epoch_salt(1))
        assert peer.lookup(H[5:7]) == 2
        assert epoch_salt(0) is None and epoch_salt(2, "tenant") == "tenant#epoch2"
        with pytest.raises(ValueError, match="epoch must be >= 0"):
            epoch_salt(-1)
    finally:
        tier.close()


def test_an_answer_in_before_this_engine_stored_the_block_is_not_handed_out() -> None:
    """A conversation's turn missed and went on without its answer; its next turn came
    back within max_age_s (one at a time, six conversations of 0.3 s each) and was handed
    that miss for the history this engine had stored since: recomputed. A store makes
    the answers already in that asked about the block stale, of one block or of
    several: asked again, still there to peek at; a question still in flight is left to
    its round trip."""
    store = _CountingStore(answer=0)
    lookups = AsyncLookups(cast(Any, store), None, max_age_s=60.0)
    try:
        for question in (H[:1], H[1:2], H[2:4], H[5:6]):
            assert lookups.lookup(question) is None
        assert lookups.wait(timeout=30)
        store.answer = 1
        lookups.stored([H[0], H[3]])  # H[1:2] and H[5:6] not stored: their answers stand
        # what the tier said when asked stays there to peek at (the hit share of requests
        # that went on without their answers counts it)
        assert [lookups.peek(q) for q in (H[:1], H[2:4], H[1:2], H[5:6])] == [0, 0, 0, 0]
        assert lookups.lookup(H[:1]) is None  # asked again, not the stale miss
        assert lookups.lookup(H[2:4]) is None
        assert lookups.lookup(H[1:2]) == 0
        assert lookups.wait(timeout=30)
        assert (lookups.lookup(H[:1]), lookups.lookup(H[2:4])) == (1, 1)
    finally:
        lookups.close()


def test_a_manager_store_refreshes_a_miss_answered_before_it(redis_server: RedisServer) -> None:
    with tier_for(redis_server) as tier:
        manager = tier.manager(async_lookup=True, synthetic_payload_bytes=32)
        assert manager.lookup(H[:1]) is None  # a cold prompt asks and goes on without it
        assert manager.wait_lookups(timeout=30)
        store_all(manager, H[:1])  # then computes the block and stores it
        assert manager.lookup(H[:1]) is None  # the next turn's question is asked afresh
        assert manager.wait_lookups(timeout=30)
        assert manager.lookup(H[:1]) == 1
