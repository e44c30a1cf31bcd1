"""Repeated hashes and keys that are not bytes, on every local offloading manager.

vLLM accepts a hash listed twice in one call, so a ported engine may send one;
the decisions are in docs/vllm-differences.md. The first test is issue 17's
report: a failed `complete_store` listing an in-flight hash twice freed its slot
twice, and two live blocks later shared it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.offload import (
    CascadeOffloadingManager,
    CPUBackend,
    CPUOffloadingManager,
    DiskOffloadingManager,
    FilterReusedOffloadingManager,
    OffloadingManager,
    PolicyOffloadingManager,
)
from kvtier.types import BlockHash, int_block_hash

A, B, C, D = (int_block_hash(i) for i in range(4))


def _cascade() -> CascadeOffloadingManager:
    cpu = PolicyOffloadingManager(CPUBackend(16, 1), "lru", enable_events=True)
    disk = DiskOffloadingManager(16, 1, "lru", enable_events=True)
    return CascadeOffloadingManager(cpu, disk, promote=False, enable_events=True)


# every manager with room for exactly two blocks
MANAGERS: dict[str, Callable[[], OffloadingManager]] = {
    "cpu-lru": lambda: CPUOffloadingManager(16, 2, "lru", enable_events=True),
    "cpu-arc": lambda: CPUOffloadingManager(16, 2, "arc", enable_events=True),
    "disk": lambda: DiskOffloadingManager(16, 2, "lru", enable_events=True),
    "filter": lambda: FilterReusedOffloadingManager(
        CPUOffloadingManager(16, 2, "lru", enable_events=True),
        store_threshold=1,
        count_store_offers=True,
    ),
    "cascade": _cascade,
}


@pytest.fixture(params=sorted(MANAGERS))
def manager(request: pytest.FixtureRequest) -> OffloadingManager:
    return MANAGERS[request.param]()


def stored(manager: OffloadingManager, *hashes: BlockHash) -> list[BlockHash] | None:
    out = manager.prepare_store(list(hashes))
    return None if out is None else out.block_hashes_to_store


def events(manager: OffloadingManager) -> list[tuple[list[BlockHash], bool]]:
    return [(e.block_hashes, e.removed) for e in manager.take_events()]


def test_issue_17_failed_store_listed_twice_frees_its_slot_once() -> None:
    m = CPUOffloadingManager(block_size=16, num_blocks=2, cache_policy="lru", enable_events=True)
    m.prepare_store([A])
    m.complete_store([A, A], success=False)
    slots = []
    for block_hash in (B, C, D):
        out = m.prepare_store([block_hash])
        slots.append(None if out is None else out.store_spec.block_ids.tolist())  # type: ignore[attr-defined]
    assert slots == [[1], [0], None]  # vLLM's answer; the bug gave [1], [0], [0]
    assert len(m) == 2


def test_failed_store_listed_twice_leaves_room_for_two(manager: OffloadingManager) -> None:
    assert stored(manager, A) == [A]
    manager.complete_store([A, A], success=False)
    assert stored(manager, B) == [B]
    assert stored(manager, C) == [C]
    assert manager.prepare_store([D]) is None  # two stores in flight fill the room
    manager.complete_store([B, C, B])
    assert manager.lookup([B]) == 1 and manager.lookup([C]) == 1


def test_successful_store_listed_twice_is_one_store_event(manager: OffloadingManager) -> None:
    assert stored(manager, A) == [A]
    manager.complete_store([A, A, A])
    assert events(manager) == [([A], False)]
    assert manager.lookup([A, A]) == 2


def test_store_offer_listed_twice_takes_one_slot(manager: OffloadingManager) -> None:
    assert stored(manager, A, B, A) == [A, B]
    manager.complete_store([A, B])
    assert stored(manager, B, B) == []  # present: nothing to store
    stores = [h for hashes, removed in events(manager) if not removed for h in hashes]
    assert sorted(stores) == [A, B]  # (the cascade reports them per tier)


def test_load_listed_twice_pins_twice(manager: OffloadingManager) -> None:
    assert stored(manager, A, B) == [A, B]
    manager.complete_store([A, B])
    manager.prepare_load([A, A])  # as vLLM: one pin per listing
    manager.complete_load([A])
    assert stored(manager, C) == [C]  # B evicted: A is still pinned once
    manager.complete_store([C])
    manager.complete_load([A])
    with pytest.raises((KeyError, ValueError), match="not being loaded"):
        manager.complete_load([A])
    assert stored(manager, D) == [D]  # A evictable again


def test_complete_load_listing_a_hash_twice_releases_two_pins(
    manager: OffloadingManager,
) -> None:
    assert stored(manager, A) == [A]
    manager.complete_store([A])
    manager.prepare_load([A])
    with pytest.raises((KeyError, ValueError), match="not being loaded"):
        manager.complete_load([A, A])  # two releases, one pin: refused, nothing released
    manager.prepare_load([A])
    manager.complete_load([A, A])
    with pytest.raises((KeyError, ValueError), match="not being loaded"):
        manager.complete_load([A])


BAD_KEYS: list[Any] = ["abc", 7, None, ["a"]]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=repr)
@pytest.mark.parametrize("call", ["prepare_store", "complete_store", "prepare_load", "touch"])
def test_a_key_that_is_not_bytes_is_refused_before_anything_changes(
    manager: OffloadingManager, call: str, bad: Any
) -> None:
    assert stored(manager, A) == [A]
    if call != "complete_store":
        manager.complete_store([A])
    events(manager)
    message = rf"{call}: a block hash must be bytes .* got {re.escape(repr(bad))}"
    with pytest.raises(ValueError, match=message):
        getattr(manager, call)([A, bad])
    assert events(manager) == []
    if call == "complete_store":  # A is still in flight, and completes normally
        manager.complete_store([A])
        assert events(manager) == [([A], False)]
    assert manager.lookup([A]) == 1
    assert stored(manager, B) == [B]  # one slot still free
    manager.complete_store([B])
    assert manager.prepare_store([C]) is not None  # no pin was left behind


def test_issue_15_disk_manager_refuses_a_str_key_with_state_unchanged() -> None:
    freed: list[Any] = []
    m = DiskOffloadingManager(16, 3, on_free=freed.extend)
    m.prepare_store([A])
    before = (len(m), m.backend.get_num_free_blocks())
    with pytest.raises(ValueError, match="'abc' of type str"):
        m.prepare_store(["abc"])  # type: ignore[list-item]
    assert (len(m), m.backend.get_num_free_blocks()) == before == (1, 2)
    assert "abc" not in m and freed == []


def test_cpu_manager_stores_no_str_key() -> None:
    m = CPUOffloadingManager(16, 2)
    with pytest.raises(ValueError, match="bytes"):
        m.prepare_store(["abc"])  # type: ignore[list-item]
    assert len(m) == 0 and "abc" not in m
