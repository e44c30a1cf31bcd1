"""The shared offloading-manager suite (tests/offload/suite.py) on the disk tier and the cascade."""

from __future__ import annotations

from typing import Any

from hypothesis import settings

from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.offload.cpu import CPUBackend
from kvtier.offload.disk_manager import DiskOffloadingManager
from kvtier.offload.policy_manager import PolicyOffloadingManager
from tests.offload.suite import offloading_manager_machine

SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None)


def _ghosts(manager: Any) -> Any:
    return manager.policy.ghost_sizes()


TestDiskLRU = offloading_manager_machine(
    lambda: DiskOffloadingManager(16, 4, "lru", enable_events=True),
    capacity=4,
    exact_rejections=True,
).TestCase
TestDiskLRU.settings = SETTINGS

TestDiskARC = offloading_manager_machine(
    lambda: DiskOffloadingManager(16, 4, "arc", enable_events=True),
    capacity=4,
    ghost_sizes=_ghosts,
).TestCase
TestDiskARC.settings = SETTINGS


def _cascade(cpu_policy: str, disk_policy: str) -> Any:
    def build() -> CascadeOffloadingManager:
        cpu = PolicyOffloadingManager(CPUBackend(16, 2), cpu_policy, enable_events=True)
        disk = DiskOffloadingManager(16, 3, disk_policy, enable_events=True)
        return CascadeOffloadingManager(cpu, disk, promote=False, enable_events=True)

    return build


# Demotion with promotion off keeps the tiers disjoint, so the suite's single-tier
# model (capacity = CPU + disk) applies exactly, evictions aside: a CPU eviction
# demotes instead of evicting, so the cascade evicts other than "exactly the shortfall".
TestCascadeLRU = offloading_manager_machine(
    _cascade("lru", "lru"), capacity=5, exact_evictions=False, check_slots=False
).TestCase
TestCascadeLRU.settings = SETTINGS

TestCascadeARC = offloading_manager_machine(
    _cascade("arc", "lru"), capacity=5, exact_evictions=False, check_slots=False
).TestCase
TestCascadeARC.settings = SETTINGS
