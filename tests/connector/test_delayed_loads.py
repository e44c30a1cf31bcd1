"""Blocks filled by an asynchronous load enter the accelerator prefix cache only once
their bytes are there: another request must never hit a block still loading, or one
whose load failed (an engine would read garbage KV)."""

from __future__ import annotations

import pytest

from kvtier.connector import Admission, OffloadConnector
from kvtier.request import Request
from kvtier.types import int_block_hash
from tests.connector.test_connector import BS, _connector, _request, _run

IDS = [1, 2, 3]


def _loading() -> tuple[OffloadConnector, Request, Admission]:
    """a's three blocks live only in the CPU tier; a2 (same prefix) is admitted with a
    load of all three in flight, and 4 accelerator blocks are left free."""
    c = _connector(gpu_blocks=8, cpu_blocks=16)
    _run(c, _request("a", IDS))
    _run(c, _request("b", [7, 8, 9, 10, 11, 12, 13]))  # 8 blocks: evicts all of a
    assert not any(c.gpu.is_cached(int_block_hash(i)) for i in IDS)
    a2 = _request("a2", IDS)
    adm = c.admit(a2)
    assert adm is not None and adm.load is not None
    assert (adm.gpu_hit_blocks, adm.offload_hit_blocks) == (0, 3)
    return c, a2, adm


def _gpu_hit(c: OffloadConnector, rid: str) -> int:
    return c.gpu.get_computed_blocks(_request(rid, IDS))[1] // BS


def test_in_flight_load_is_not_a_hit_until_it_finishes() -> None:
    c, a2, adm = _loading()
    assert not any(c.gpu.is_cached(int_block_hash(i)) for i in IDS)
    assert _gpu_hit(c, "probe") == 0
    assert adm.load is not None
    c.finish_load(adm.load)
    assert all(c.gpu.is_cached(int_block_hash(i)) for i in IDS)
    assert _gpu_hit(c, "probe") == 3
    assert a2.num_computed_tokens == a2.num_tokens
    assert c.computed(a2) is None
    c.finish(a2)


def test_second_request_during_the_load_goes_to_the_tier_not_the_accelerator() -> None:
    c, _, _ = _loading()
    other = c.admit(_request("c", IDS))
    assert other is not None and (other.gpu_hit_blocks, other.offload_hit_blocks) == (0, 3)


def test_failed_load_is_a_miss_recomputed_then_cached() -> None:
    c, a2, adm = _loading()
    assert adm.load is not None
    c.finish_load(adm.load, ok=False)
    assert c.counters.failed_loads == 1
    assert a2.num_computed_tokens == 0  # back to the accelerator hit: recompute
    assert not any(c.gpu.is_cached(int_block_hash(i)) for i in IDS)
    assert _gpu_hit(c, "probe") == 0
    assert c.computed(a2) is None  # the prefill recomputed them: now they may be hit
    assert a2.num_computed_tokens == a2.num_tokens
    assert all(c.gpu.is_cached(int_block_hash(i)) for i in IDS)
    assert _gpu_hit(c, "probe") == 3
    c.finish(a2)


def test_computed_refused_while_the_load_is_in_flight() -> None:
    c, a2, adm = _loading()
    with pytest.raises(ValueError, match="load in flight"):
        c.computed(a2)
    assert adm.load is not None
    c.finish_load(adm.load)
    assert c.computed(a2) is None  # the refused call changed nothing
    c.finish(a2)


def test_load_of_a_preempted_request_only_unpins() -> None:
    c, a2, adm = _loading()
    c.preempt(a2)
    again = c.admit(a2)  # same request, a new load of the same blocks
    assert again is not None and again.load is not None
    assert adm.load is not None
    c.finish_load(adm.load)  # the old job: must not cache the new allocation
    assert not any(c.gpu.is_cached(int_block_hash(i)) for i in IDS)
    c.finish_load(again.load)
    assert all(c.gpu.is_cached(int_block_hash(i)) for i in IDS)
    assert c.jobs_in_flight == 0
    c.finish(a2)


def test_refused_prepare_load_rolls_the_admission_back(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _connector(gpu_blocks=8, cpu_blocks=16)
    _run(c, _request("a", IDS))
    _run(c, _request("b", [7, 8, 9, 10, 11, 12, 13]))
    free, admitted = c.gpu.num_free_blocks, c.counters.admitted

    def refuse(hashes: object) -> None:
        raise RuntimeError("tier gone")

    monkeypatch.setattr(c.offload, "prepare_load", refuse)
    a2 = _request("a2", IDS)
    with pytest.raises(RuntimeError, match="tier gone"):
        c.admit(a2)
    assert not c.gpu.has_request("a2") and c.gpu.num_free_blocks == free
    assert c.counters.admitted == admitted and c.jobs_in_flight == 0
    assert a2.num_computed_tokens == 0
    with pytest.raises(KeyError, match="not admitted"):
        c.computed(a2)
    monkeypatch.undo()
    assert _run(c, a2) == (0, 3)  # admitted cleanly afterwards


def test_refused_stores_of_evicted_blocks_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _connector(gpu_blocks=3, cpu_blocks=8, store_on="evict")
    _run(c, _request("a", [1, 2]))
    monkeypatch.setattr(c.offload, "prepare_store", lambda hashes: None)
    adm = c.admit(_request("b", [5, 6]))  # evicts a's two blocks; the tier refuses them
    assert adm is not None and adm.stores == []
    assert c.counters.evicted_blocks_dropped == 2 and c.counters.store_rejections == 1
