"""The scheduler-side connector: scenarios, then a model-based test of its protocol."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.connector import OffloadConnector, TransferJob
from kvtier.offload import CPUOffloadingManager
from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.request import Request
from kvtier.types import BlockHash, int_block_hash

BS = 4


def _request(rid: str, ids: list[int], extra_tokens: int = 1) -> Request:
    """A request whose full blocks carry `ids`, plus a partial tail of `extra_tokens`."""
    hashes = [int_block_hash(i) for i in ids]
    return Request.from_block_hashes(rid, hashes, len(ids) * BS + extra_tokens, block_size=BS)


def _connector(gpu_blocks: int, cpu_blocks: int, store_on: str = "compute") -> OffloadConnector:
    offload = CPUOffloadingManager(BS, cpu_blocks, cache_policy="lru")
    return OffloadConnector.create(
        offload,
        block_size=BS,
        num_gpu_blocks=gpu_blocks,
        max_model_len=256,
        store_on=store_on,  # type: ignore[arg-type]
    )


def _run(c: OffloadConnector, request: Request) -> tuple[int, int]:
    """Admit, finish loads, store what was computed, finish: as the sequential replay."""
    adm = c.admit(request)
    assert adm is not None
    if adm.load is not None:
        c.finish_load(adm.load)
    for job in adm.stores:
        c.finish_store(job)
    job = c.computed(request)
    if job is not None:
        c.finish_store(job)
    c.finish(request)
    return adm.gpu_hit_blocks, adm.offload_hit_blocks


def test_offload_tier_continues_the_accelerator_prefix() -> None:
    c = _connector(gpu_blocks=4, cpu_blocks=16)
    assert _run(c, _request("a", [1, 2, 3])) == (0, 0)
    # b needs all 4 accelerator blocks: a's cached blocks are evicted (tail first).
    assert _run(c, _request("b", [7, 8, 9])) == (0, 0)
    assert c.counters.gpu_evictions == 3
    a2 = _request("a2", [1, 2, 3])
    adm = c.admit(a2)
    assert adm is not None and (adm.gpu_hit_blocks, adm.offload_hit_blocks) == (0, 3)
    load = adm.load
    assert load is not None and load.block_hashes == [int_block_hash(i) for i in (1, 2, 3)]
    assert load.gpu_block_ids == c.gpu.get_block_ids("a2")[:3]
    assert isinstance(load.spec, CPULoadStoreSpec) and len(load.spec.block_ids) == 3
    c.finish_load(load)
    assert c.computed(a2) is None  # nothing new was computed: nothing to store
    c.finish(a2)


def test_at_least_one_token_is_computed() -> None:
    c = _connector(gpu_blocks=2, cpu_blocks=8)
    _run(c, _request("a", [1, 2], extra_tokens=0))
    _run(c, _request("x", [5, 6], extra_tokens=0))  # evicts a from the accelerator
    # Same 8 tokens again: only the first block may be a hit, the last is recomputed.
    assert _run(c, _request("a2", [1, 2], extra_tokens=0)) == (0, 1)


def test_accelerator_and_offload_hits_combine() -> None:
    c = _connector(gpu_blocks=6, cpu_blocks=16)
    _run(c, _request("a", [1, 2, 3, 4]))
    _run(c, _request("b", [1, 2, 5, 6, 7]))  # evicts a's tail (4, then 3) from the accelerator
    assert _run(c, _request("a2", [1, 2, 3, 4])) == (2, 2)


def test_no_room_changes_nothing() -> None:
    c = _connector(gpu_blocks=3, cpu_blocks=8)
    _run(c, _request("a", [1, 2]))
    free_before = c.gpu.num_free_blocks
    assert c.admit(_request("big", [1, 2, 3, 4, 5])) is None
    assert c.gpu.num_free_blocks == free_before and c.jobs_in_flight == 0
    assert c.counters.refused == 1
    assert c.offload.prepare_store([int_block_hash(i) for i in range(20, 28)]) is not None


def test_store_on_eviction_stores_only_evicted_blocks() -> None:
    c = _connector(gpu_blocks=3, cpu_blocks=8, store_on="evict")
    _run(c, _request("a", [1, 2]))
    assert c.offload.lookup([int_block_hash(1)]) == 0  # computed, but not stored
    adm = c.admit(_request("b", [5, 6]))  # needs the blocks a left cached
    assert adm is not None and len(adm.stores) == 1
    (job,) = adm.stores
    assert set(job.block_hashes) == {int_block_hash(1), int_block_hash(2)}
    c.finish_store(job)
    assert c.offload.lookup([int_block_hash(1), int_block_hash(2)]) == 2


def test_failed_store_is_not_readable_and_failed_load_counted() -> None:
    c = _connector(gpu_blocks=8, cpu_blocks=8)
    a = _request("a", [1, 2])
    assert c.admit(a) is not None
    job = c.computed(a)
    assert job is not None
    c.finish_store(job, ok=False)
    c.finish(a)
    assert c.offload.lookup([int_block_hash(1)]) == 0
    assert c.counters.failed_stores == 1


def test_protocol_errors() -> None:
    c = _connector(gpu_blocks=8, cpu_blocks=8)
    a = _request("a", [1, 2])
    with pytest.raises(KeyError, match="not admitted"):
        c.computed(a)
    assert c.admit(a) is not None
    job = c.computed(a)
    assert job is not None
    c.finish_store(job)
    with pytest.raises(KeyError, match="already finished"):
        c.finish_store(job)
    with pytest.raises(ValueError, match="store_on"):
        OffloadConnector(c.gpu, c.offload, store_on="never")  # type: ignore[arg-type]


class ConnectorMachine(RuleBasedStateMachine):
    """Random interleavings of the engine's calls, checked against a simple model:
    which hashes the tier holds readable (stored and completed, not evicted), and which
    accelerator blocks have no bytes yet (loading, or failed and not recomputed)."""

    STORE_ON = "compute"

    def __init__(self) -> None:
        super().__init__()
        self.c = _connector(gpu_blocks=10, cpu_blocks=6, store_on=self.STORE_ON)
        self.admitted: dict[str, Request] = {}
        self.computed: set[str] = set()
        self.loads: list[TransferJob] = []
        self.stores: list[TransferJob] = []
        self.readable: set[BlockHash] = set()
        # request -> (its load job, its accelerator blocks that have no bytes yet)
        self.no_bytes: dict[str | None, tuple[int, list[int]]] = {}
        self.next_id = 0

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 4), tail=st.integers(0, 3))
    def admit(self, prefix: int, length: int, tail: int) -> None:
        ids = [prefix * 10 + i for i in range(length)]  # requests share prefixes
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = _request(rid, ids, extra_tokens=tail)
        expected_limit = (request.num_tokens - 1) // BS
        adm = self.c.admit(request)
        if adm is None:
            return
        self.admitted[rid] = request
        hit = adm.gpu_hit_blocks + adm.offload_hit_blocks
        assert hit <= expected_limit
        if adm.load is not None:
            assert set(adm.load.block_hashes) <= self.readable
            self.loads.append(adm.load)
            self.no_bytes[rid] = (adm.load.job_id, adm.load.gpu_block_ids)
        self._track_stores(adm.stores)

    def _track_stores(self, jobs: list[TransferJob]) -> None:
        for job in jobs:
            self.readable.difference_update(job.evicted)
            self.stores.append(job)

    @precondition(lambda self: self.loads)
    @rule(ok=st.booleans())
    def finish_load(self, ok: bool) -> None:
        job = self.loads.pop(0)
        self.c.finish_load(job, ok)
        entry = self.no_bytes.get(job.request_id)
        if ok and entry is not None and entry[0] == job.job_id:  # its request is live
            del self.no_bytes[job.request_id]
            assert all(self.c.gpu.is_cached(h) for h in job.block_hashes)

    @precondition(lambda self: self.stores)
    @rule(ok=st.booleans())
    def finish_store(self, ok: bool) -> None:
        job = self.stores.pop(0)
        self.c.finish_store(job, ok)
        if ok:
            self.readable.update(job.block_hashes)

    def _computable(self) -> list[str]:
        loading = {job.request_id for job in self.loads}
        return sorted(set(self.admitted) - self.computed - loading)

    @precondition(lambda self: self._computable())
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._computable()))
        job = self.c.computed(self.admitted[rid])
        self.computed.add(rid)
        self.no_bytes.pop(rid, None)  # the prefill (re)computed them
        if job is not None:
            assert job.request_id == rid
            self._track_stores([job])

    @precondition(lambda self: self.admitted)
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data: st.DataObject, preempt: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.admitted)))
        request = self.admitted.pop(rid)
        self.computed.discard(rid)
        self.no_bytes.pop(rid, None)
        (self.c.preempt if preempt else self.c.finish)(request)

    @invariant()
    def tier_serves_exactly_the_readable_blocks(self) -> None:
        for h in {int_block_hash(p * 10 + i) for p in range(3) for i in range(4)}:
            assert (self.c.offload.lookup([h]) == 1) == (h in self.readable)

    @invariant()
    def blocks_without_bytes_are_never_hits(self) -> None:
        for rid, (_, ids) in self.no_bytes.items():
            assert rid is not None
            blocks = {b.block_id: b for b in self.c.gpu.get_blocks(rid)}
            assert all(blocks[i].block_hash is None for i in ids)

    @invariant()
    def pinned_blocks_are_never_evicted(self) -> None:
        pinned = {h for job in self.loads for h in job.block_hashes}
        assert pinned <= self.readable
        assert self.c.jobs_in_flight == len(self.loads) + len(self.stores)


class EvictStoreMachine(ConnectorMachine):
    STORE_ON = "evict"


TestConnectorMachine = ConnectorMachine.TestCase
TestConnectorMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
TestEvictStoreMachine = EvictStoreMachine.TestCase
TestEvictStoreMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
