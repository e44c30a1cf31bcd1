"""kvtier's policies inside vLLM's own CPU tier decide exactly as kvtier's own manager.

vLLM's real `CPUOffloadingManager` loads each policy the way a user configures it
(`cache_policy="kvtier_<name>"`, `cache_policy_module_path="kvtier.vllm"`, through
vLLM's `CachePolicyFactory`); kvtier's `CPUOffloadingManager` runs the same policy
beside it. Each request goes through vLLM's connector flow (lookups key by key,
loads of the hits, one store offer of the rest, completions, request finished) and
kvtier's manager gets the same calls, with vLLM's request-scoped hooks as the
touches `kvtier.vllm.cpu_policies.cache_policies` documents: the store misses before the offer,
the reused keys at the end. Every answer, slot and event must agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvtier.offload import CPUOffloadingManager as KvtierManager
from kvtier.offload.policies import available_policies
from kvtier.sim.traces import TraceRequest
from tests.vllm.needs_vllm import quiet, require_vllm

require_vllm()

with quiet():
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    import kvtier.vllm
    from kvtier.vllm.cpu_policies.cache_policies import policy_names


POLICIES = available_policies()
TRACE_REQUESTS = 3000  # a prefix of the public trace: ~2 s per policy
TRACE_CAPACITY = 600  # blocks: small enough for evictions from the first hundred requests


def key(value: int) -> bytes:
    return make_offload_key(value.to_bytes(8, "big"), 0)


@dataclass
class Request:
    """One request's open business in both managers."""

    ctx: ReqContext
    keys: list[bytes]
    loaded: list[bytes]
    stored: list[bytes] | None  # None: the offer was refused
    reused: list[bytes] = field(default_factory=list)


class Pair:
    """vLLM's manager with a kvtier policy, and kvtier's manager with that policy."""

    def __init__(self, policy: str, capacity: int) -> None:
        self.vllm = VllmManager(
            num_chunks=capacity,
            cache_policy=f"kvtier_{policy}",
            cache_policy_module_path="kvtier.vllm",
            enable_events=True,
        )
        self.ours = KvtierManager(16, capacity, policy, enable_events=True)

    def start(self, req_id: str, keys: list[bytes]) -> Request:
        """Lookups, a load of the hits and a store offer of the rest, compared."""
        ctx = ReqContext(req_id=req_id)
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * 16)
        self.vllm.on_new_request(ctx)
        hits = 0
        while hits < len(keys) and self.vllm.lookup(keys[hits], ctx) is LookupResult.HIT:
            hits += 1
        assert self.ours.lookup(keys) == hits
        loaded = keys[:hits]
        if loaded:
            theirs = self.vllm.prepare_load(loaded, ctx).block_ids.tolist()  # type: ignore[attr-defined]
            assert self.ours.prepare_load(loaded).block_ids.tolist() == theirs  # type: ignore[attr-defined]
        offer = keys[hits:]
        blocks = [self.ours.get_block(k) for k in offer]  # type: ignore[arg-type]
        ready = [k for k, b in zip(offer, blocks, strict=True) if b is not None and b.ref_cnt >= 0]
        missed = [k for k, b in zip(offer, blocks, strict=True) if b is None]
        if missed:  # vLLM calls on_store_miss only with misses (a touch may count a request)
            self.ours.touch(missed)  # type: ignore[arg-type]
        theirs_out = self.vllm.prepare_store(offer, ctx)
        ours_out = self.ours.prepare_store(offer)  # type: ignore[arg-type]
        if theirs_out is None or ours_out is None:
            assert theirs_out is None and ours_out is None
            stored = None
        else:
            stored = list(theirs_out.keys_to_store)
            assert ours_out.block_hashes_to_store == stored
            assert ours_out.block_hashes_evicted == theirs_out.evicted_keys
            ours_ids = ours_out.store_spec.block_ids.tolist()  # type: ignore[attr-defined]
            assert ours_ids == theirs_out.store_spec.block_ids.tolist()  # type: ignore[attr-defined]
        self.check_events()
        return Request(ctx, keys, loaded, stored, reused=loaded + ready)

    def complete_load(self, request: Request) -> None:
        self.vllm.complete_load(request.loaded, request.ctx)
        self.ours.complete_load(request.loaded)  # type: ignore[arg-type]

    def complete_store(self, request: Request, success: bool) -> None:
        assert request.stored is not None
        self.vllm.complete_store(request.stored, request.ctx, success)
        self.ours.complete_store(request.stored, success)  # type: ignore[arg-type]
        self.check_events()

    def finish(self, request: Request) -> None:
        self.vllm.on_request_finished(request.ctx)
        reused = set(request.reused)
        if reused:
            self.ours.touch([k for k in request.keys if k in reused])  # type: ignore[misc]

    def check_events(self) -> None:
        theirs = [(e.keys, e.medium.value, e.removed) for e in self.vllm.take_events()]
        ours = [(e.block_hashes, e.medium, e.removed) for e in self.ours.take_events()]
        assert ours == theirs

    def check_lookups(self, keys: Iterable[bytes]) -> None:
        ctx = ReqContext(req_id="probe")
        for k in keys:
            block = self.ours.get_block(k)  # type: ignore[arg-type]
            expected = (
                LookupResult.MISS
                if block is None
                else LookupResult.HIT_PENDING
                if block.ref_cnt < 0
                else LookupResult.HIT
            )
            assert self.vllm.lookup(k, ctx) is expected


def test_every_registered_policy_loads_through_vllms_factory() -> None:
    assert policy_names() == [f"kvtier_{p}" for p in POLICIES]
    assert {"kvtier_lru", "kvtier_arc"} <= set(policy_names())
    for name in policy_names():
        cls = CachePolicyFactory.get_cache_policy_cls(name, "kvtier.vllm")
        assert issubclass(cls, CachePolicy)
        assert cls is getattr(kvtier.vllm, name)  # one class per name
        assert cls.__name__ == name


def test_an_unknown_policy_names_the_available_ones() -> None:
    with pytest.raises(AttributeError, match=r"'kvtier_nope'.*kvtier_arc.*kvtier_lru"):
        CachePolicyFactory.get_cache_policy_cls("kvtier_nope", "kvtier.vllm")


@pytest.mark.parametrize("policy", POLICIES)
def test_same_decisions_on_the_public_trace(
    policy: str, conversation_trace: list[TraceRequest]
) -> None:
    pair = Pair(policy, TRACE_CAPACITY)
    for i, request in enumerate(conversation_trace[:TRACE_REQUESTS]):
        keys = list(dict.fromkeys(key(h) for h in request.hash_ids))
        req = pair.start(f"r{i}", keys)
        pair.complete_load(req)
        if req.stored is not None:
            pair.complete_store(req, True)
        pair.finish(req)
    assert pair.ours.counters.evicted_blocks > 10 * TRACE_CAPACITY  # the policy decided a lot


UNIVERSE = [key(i) for i in range(12)]
CAPACITY = 4


class SameDecisions(RuleBasedStateMachine):
    """Random interleavings: loads and stores stay in flight across other requests,
    stores fail, requests finish before their stores complete."""

    policy: str = "lru"
    open_requests = Bundle("open_requests")

    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair(self.policy, CAPACITY)
        self.count = 0

    @rule(
        target=open_requests,
        keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=6, unique=True),
    )
    def start(self, keys: list[bytes]) -> Any:
        self.count += 1
        return self.pair.start(f"r{self.count}", keys)

    @rule(req=open_requests)
    def complete_load(self, req: Request) -> None:
        if req.loaded:
            self.pair.complete_load(req)
            req.loaded = []

    @rule(req=open_requests, success=st.booleans())
    def complete_store(self, req: Request, success: bool) -> None:
        if req.stored:
            self.pair.complete_store(req, success)
            req.stored = []

    @rule(req=consumes(open_requests))
    def finish(self, req: Request) -> None:
        self.pair.finish(req)
        # completions may still come after the request finished
        if req.loaded:
            self.pair.complete_load(req)
        if req.stored:
            self.pair.complete_store(req, True)

    @invariant()
    def same_contents(self) -> None:
        self.pair.check_lookups(UNIVERSE)


@pytest.mark.parametrize("policy", POLICIES)
def test_same_decisions_on_random_calls(policy: str) -> None:
    machine = type(f"SameDecisions_{policy}", (SameDecisions,), {"policy": policy})
    test_case = machine.TestCase
    test_case.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
    test_case().runTest()
