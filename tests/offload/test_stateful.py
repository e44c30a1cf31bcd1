"""The shared stateful suite on kvtier's LRU and ARC managers, alone and mirrored
against the vLLM reference port (so random interleavings also check decisions)."""

from __future__ import annotations

from typing import Any

from hypothesis import settings

from kvtier.offload import (
    ARCOffloadingManager,
    CPUBackend,
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    LRUOffloadingManager,
    OffloadingManager,
)
from tests.offload.suite import offloading_manager_machine
from tests.reference.vllm_offload import ReferenceCPUOffloadingManager

CAPACITY = 4
SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)


def _ghosts(manager: OffloadingManager) -> Any:
    return manager.policy.ghost_sizes()  # type: ignore[attr-defined]


def _cpu(policy: str) -> Any:
    return lambda: CPUOffloadingManager(16, CAPACITY, policy, enable_events=True)


def _reference(policy: str) -> Any:
    return lambda: ReferenceCPUOffloadingManager(16, CAPACITY, policy, enable_events=True)


TestLRU = offloading_manager_machine(
    lambda: LRUOffloadingManager(CPUBackend(16, CAPACITY), enable_events=True),
    capacity=CAPACITY,
    exact_rejections=True,
    check_ref_counts=True,
).TestCase
TestLRU.settings = SETTINGS

TestARC = offloading_manager_machine(
    lambda: ARCOffloadingManager(CPUBackend(16, CAPACITY), enable_events=True),
    capacity=CAPACITY,
    ghost_sizes=_ghosts,
    check_ref_counts=True,
).TestCase
TestARC.settings = SETTINGS

TestLRUMatchesReference = offloading_manager_machine(
    _cpu("lru"), capacity=CAPACITY, reference=_reference("lru")
).TestCase
TestLRUMatchesReference.settings = SETTINGS

TestARCMatchesReference = offloading_manager_machine(
    _cpu("arc"), capacity=CAPACITY, ghost_sizes=_ghosts, reference=_reference("arc")
).TestCase
TestARCMatchesReference.settings = SETTINGS

# store_threshold=1 counting offers: every offered block is stored, so the filter
# must behave exactly as the manager it wraps (repeated hashes included).
TestFilterPassThrough = offloading_manager_machine(
    lambda: FilterReusedOffloadingManager(
        _cpu("lru")(), store_threshold=1, count_store_offers=True
    ),
    capacity=CAPACITY,
    exact_rejections=True,
).TestCase
TestFilterPassThrough.settings = SETTINGS

# the tier stack's CPU tier: freed slots before never-used ones (test_cpu_slots has the
# order itself); every other rule of the suite holds as with vLLM's order
TestFreedSlotsFirst = offloading_manager_machine(
    lambda: CPUOffloadingManager(16, CAPACITY, "arc", enable_events=True, reuse_freed_first=True),
    capacity=CAPACITY,
    ghost_sizes=_ghosts,
    check_ref_counts=True,
).TestCase
TestFreedSlotsFirst.settings = SETTINGS
