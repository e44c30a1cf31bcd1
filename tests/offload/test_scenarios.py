"""Scenario tests, one per decision in docs/semantics.md sections 3 and 4."""

from __future__ import annotations

import pytest

from kvtier.offload import (
    ARCOffloadingManager,
    CPUBackend,
    CPUOffloadingManager,
    OffloadingEvent,
    PolicyOffloadingManager,
)
from kvtier.types import BlockHash, int_block_hash


def h(*ids: int) -> list[BlockHash]:
    return [int_block_hash(i) for i in ids]


def store(manager: PolicyOffloadingManager, *ids: int) -> tuple[list[int], list[BlockHash]]:
    """Store and complete; returns (slot ids, evicted hashes)."""
    out = manager.prepare_store(h(*ids))
    assert out is not None
    manager.complete_store(out.block_hashes_to_store)
    return out.store_spec.block_ids.tolist(), out.block_hashes_evicted  # type: ignore[attr-defined]


def events(manager: PolicyOffloadingManager) -> list[tuple[list[BlockHash], bool]]:
    return [(e.block_hashes, e.removed) for e in manager.take_events()]


@pytest.fixture(params=["lru", "arc", "reuse"])
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["lru", "arc"])
def oldest_first(request: pytest.FixtureRequest) -> str:
    """Policies that evict a store's blocks in the order stored (`reuse` stores and
    evicts deepest first, see tests/offload/test_reuse.py)."""
    return str(request.param)


# --- section 3: the manager ------------------------------------------------


def test_lookup_counts_leading_ready_blocks_only(policy: str) -> None:
    m = CPUOffloadingManager(16, 8, policy)
    store(m, 1, 2)
    assert m.prepare_store(h(3)) is not None  # 3 in flight
    assert m.lookup(h(1, 2, 3)) == 2
    assert m.lookup(h(1, 4, 2)) == 1
    assert m.lookup(h(3, 1)) == 0
    assert m.lookup([]) == 0


def test_slots_never_used_first_then_most_recently_freed(oldest_first: str) -> None:
    m = CPUOffloadingManager(16, 4, oldest_first)
    assert store(m, 1, 2) == ([0, 1], [])
    assert store(m, 3) == ([2], [])
    # one fresh slot (3) left: 4 takes it, 5 and 6 reuse the slots of evicted 1 and 2
    slots, evicted = store(m, 4, 5, 6)
    assert evicted == h(1, 2)
    assert slots == [3, 1, 0]  # fresh first, then most recently freed first


def test_prepare_store_skips_present_and_returns_empty_output_when_nothing_new(
    policy: str,
) -> None:
    m = CPUOffloadingManager(16, 4, policy)
    store(m, 1)
    assert m.prepare_store(h(9)) is not None  # in flight counts as present
    out = m.prepare_store(h(1, 9))
    assert out is not None
    assert out.block_hashes_to_store == [] and out.block_hashes_evicted == []
    assert out.store_spec.block_ids.tolist() == []  # type: ignore[attr-defined]
    out = m.prepare_store(h(2, 1, 3))
    assert out is not None and out.block_hashes_to_store == h(2, 3)


def test_lru_evicts_least_recent_and_touch_applies_in_reverse() -> None:
    m = CPUOffloadingManager(16, 4, "lru")
    store(m, 1, 2, 3, 4)
    m.touch(h(3, 1))  # reverse order: 1 then 3, so 3 ends most recent
    _, evicted = store(m, 5, 6)
    assert evicted == h(2, 4)
    _, evicted = store(m, 7)
    assert evicted == h(1)  # 1 is older than 3: a prefix's tail goes first


def test_eviction_never_takes_pinned_in_flight_or_input_blocks(oldest_first: str) -> None:
    m = CPUOffloadingManager(16, 4, oldest_first)
    store(m, 1, 2, 3)
    m.prepare_load(h(1))  # pinned
    assert m.prepare_store(h(4)) is not None  # fills the last slot, in flight
    _, evicted = store(m, 2, 5)  # 2 is an input hash: protected though evictable
    assert evicted == h(3)
    # 1 pinned, 4 in flight, 2 and 5 protected: no victim, no change
    assert m.prepare_store(h(2, 5, 6)) is None
    m.complete_load(h(1))
    _, evicted = store(m, 6)
    assert evicted == h(1)


def test_rejected_store_changes_nothing(policy: str) -> None:
    m = CPUOffloadingManager(16, 2, policy, enable_events=True)
    store(m, 1, 2)
    m.prepare_load(h(1, 2))
    events(m)
    assert m.prepare_store(h(3)) is None
    assert events(m) == []
    assert m.lookup(h(1, 2)) == 2 and len(m) == 2
    assert m.counters.store_rejections == 1


def test_failed_store_frees_its_slots_and_records_no_event(policy: str) -> None:
    m = CPUOffloadingManager(16, 3, policy, enable_events=True)
    store(m, 1)
    out = m.prepare_store(h(2, 3))
    assert out is not None
    m.complete_store(h(1, 2, 3, 9), success=False)  # 1 ready and 9 absent: ignored
    assert events(m) == [(h(1), False)]
    assert m.lookup(h(1)) == 1 and 2 not in m and len(m) == 1
    assert store(m, 4, 5) == ([2, 1], [])  # 2's slot then 3's were freed: 3's comes back first
    assert m.counters.failed_stores == 2


def test_complete_store_ignores_absent_and_ready_hashes(policy: str) -> None:
    m = CPUOffloadingManager(16, 4, policy, enable_events=True)
    store(m, 1)
    assert m.prepare_store(h(2)) is not None
    m.complete_store(h(9, 1, 2))
    assert events(m) == [(h(1), False), (h(2), False)]


def test_events_removal_recorded_before_the_store_that_caused_it(oldest_first: str) -> None:
    m = CPUOffloadingManager(16, 2, oldest_first, enable_events=True)
    store(m, 1, 2)
    store(m, 3)
    evs = list(m.take_events())
    assert [(e.block_hashes, e.removed) for e in evs] == [
        (h(1, 2), False),
        (h(1), True),
        (h(3), False),
    ]
    assert evs[0] == OffloadingEvent(h(1, 2), 16, "CPU", False)
    assert list(m.take_events()) == []  # forgotten once taken


def test_events_disabled_records_nothing(policy: str) -> None:
    m = CPUOffloadingManager(16, 2, policy)
    store(m, 1, 2)
    store(m, 3)
    assert list(m.take_events()) == []


def test_load_spec_lists_slots_in_input_order(policy: str) -> None:
    m = CPUOffloadingManager(16, 4, policy)
    store(m, 1, 2, 3)
    spec = m.prepare_load(h(3, 1))
    assert spec.block_ids.tolist() == [2, 0]  # type: ignore[attr-defined]


# --- caller mistakes: errors, state unchanged --------------------------------


def test_loading_absent_or_in_flight_block_raises_and_pins_nothing(policy: str) -> None:
    m = CPUOffloadingManager(16, 2, policy)
    store(m, 1)
    assert m.prepare_store(h(2)) is not None
    with pytest.raises(KeyError, match="not stored"):
        m.prepare_load(h(1, 9))
    with pytest.raises(ValueError, match="not ready"):
        m.prepare_load(h(1, 2))
    # 1 was not left pinned: it can be evicted, and a completion is rejected
    with pytest.raises(ValueError, match="not being loaded"):
        m.complete_load(h(1))
    m.complete_store(h(2))
    _, evicted = store(m, 3)
    assert evicted == h(1)


def test_completing_a_load_twice_raises_and_unpins_nothing(policy: str) -> None:
    m = CPUOffloadingManager(16, 2, policy)
    store(m, 1, 2)
    m.prepare_load(h(1, 2))
    m.complete_load(h(1))
    with pytest.raises(ValueError, match="not being loaded"):
        m.complete_load(h(2, 1))
    assert m.prepare_store(h(3)) is not None  # 1 evictable, 2 still pinned
    assert m.prepare_store(h(4)) is None
    with pytest.raises(KeyError):
        m.complete_load(h(9))


def test_complete_load_releases_one_load_per_listing(policy: str) -> None:
    m = CPUOffloadingManager(16, 4, policy)
    store(m, 1)
    m.prepare_load(h(1))
    with pytest.raises(ValueError, match="not being loaded"):
        m.complete_load(h(1, 1))  # two releases, one load: rejected, nothing released
    m.prepare_load(h(1))
    m.complete_load(h(1, 1))  # two loads: both released
    with pytest.raises(ValueError, match="not being loaded"):
        m.complete_load(h(1))


def test_counters_record_what_happened() -> None:
    m = CPUOffloadingManager(16, 2, "lru")
    store(m, 1, 2)
    assert m.lookup(h(1, 2, 3)) == 2
    m.prepare_load(h(1))
    m.complete_load(h(1))
    store(m, 3)
    c = m.counters
    assert (c.lookups, c.queried_blocks, c.hit_blocks, c.loaded_blocks) == (1, 3, 2, 1)
    assert (c.stored_blocks, c.evicted_blocks, c.store_rejections) == (3, 1, 0)


def test_remove_ready_forgets_only_ready_unpinned_blocks(policy: str) -> None:
    m = CPUOffloadingManager(16, 4, policy, enable_events=True)
    store(m, 1, 2, 3)
    m.prepare_load(h(2))
    assert m.prepare_store(h(4)) is not None
    events(m)
    assert m.remove_ready(h(1, 2, 4, 9)) == h(1)
    assert events(m) == [(h(1), True)] and len(m) == 3
    assert store(m, 5) == ([0], [])  # the slot of 1 is free again


# --- section 4: ARC ----------------------------------------------------------


def arc(num_blocks: int) -> ARCOffloadingManager:
    return ARCOffloadingManager(CPUBackend(16, num_blocks), enable_events=True)


def test_arc_touch_promotes_ready_t1_blocks_to_t2() -> None:
    m = arc(4)
    store(m, 1, 2, 3, 4)
    m.touch(h(1, 2))  # T1 = [3, 4], T2 = [2, 1]
    # p = 0: T1 (size 2 >= 0) gives its least recent first
    _, evicted = store(m, 5, 6)
    assert evicted == h(3, 4)
    assert m.policy.b1 == dict.fromkeys(h(3, 4))  # type: ignore[attr-defined]


def test_arc_touch_of_a_block_in_flight_keeps_it_in_t1() -> None:
    m = arc(3)
    store(m, 1)
    assert m.prepare_store(h(2)) is not None
    m.touch(h(2, 1))  # 1 ready -> T2; 2 in flight -> refreshed in T1 only
    m.complete_store(h(2))
    t1, t2 = m.policy.keys()  # type: ignore[attr-defined]
    assert (t1, t2) == (h(2), h(1))


def test_arc_ghost_hits_adapt_the_target_and_ghosts_stay_bounded() -> None:
    m = arc(2)
    pol = m.policy
    store(m, 1, 2)
    store(m, 3, 4)  # 1, 2 -> B1
    assert pol.ghost_sizes() == (2, 0)
    m.touch(h(1))  # B1 hit: p += max(1, |B2|/|B1|) = 1
    assert pol.target_t1_size == 1  # type: ignore[attr-defined]
    m.touch(h(3, 4))  # both to T2
    store(m, 5, 6)  # T1 empty (< p): victims from T2, into B2
    assert pol.ghost_sizes() == (2, 2)
    assert list(pol.b2) == h(4, 3)  # type: ignore[attr-defined]
    m.touch(h(4))  # B2 hit: p -= max(1, |B1|/|B2|) = 1
    assert pol.target_t1_size == 0  # type: ignore[attr-defined]
    store(m, 7, 8)
    assert all(size <= 2 for size in pol.ghost_sizes())


def test_arc_evict_tracks_t1_size_as_victims_are_chosen() -> None:
    m = arc(4)
    pol = m.policy
    store(m, 1, 2, 3, 4)
    m.touch(h(3, 4))  # T1 = [1, 2], T2 = [4, 3]
    pol.target_t1_size = 1.5  # type: ignore[attr-defined]  # int(p) = 1
    # 1st victim: |T1| = 2 >= 1 -> 1; 2nd: virtual |T1| = 1 >= 1 -> 2; 3rd: 0 < 1 -> T2's 4
    _, evicted = store(m, 5, 6, 7)
    assert evicted == h(1, 2, 4)


def test_arc_fails_when_t1_is_below_target_and_t2_has_no_victim() -> None:
    m = arc(2)
    store(m, 1, 2)
    m.touch(h(2))  # T1 = [1], T2 = [2]
    m.prepare_load(h(2))
    m.policy.target_t1_size = 2.0  # type: ignore[attr-defined]
    assert m.prepare_store(h(3)) is None  # vLLM's decision: T1's 1 is not taken
    m.policy.target_t1_size = 0.0  # type: ignore[attr-defined]
    _, evicted = store(m, 3)
    assert evicted == h(1)


def test_generic_manager_takes_a_policy_instance() -> None:
    from kvtier.offload import LRUCachePolicy

    m = PolicyOffloadingManager(CPUBackend(16, 2), LRUCachePolicy(2))
    store(m, 1, 2)
    store(m, 3)
    assert m.lookup(h(2, 3)) == 2


@pytest.mark.parametrize("block_size", [0, -1, True, 1.5])
def test_backend_refuses_a_block_size_that_is_not_a_positive_int(block_size: object) -> None:
    from kvtier.offload import CPUBackend

    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        CPUBackend(block_size, 4)  # type: ignore[arg-type]
