"""Scheduler-side bookkeeping for offload tiers (no bytes move here).

The names follow vLLM's `vllm.v1.kv_offload`, so engine code ports by changing
imports.
"""

from kvtier.offload.abstract import (
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from kvtier.offload.backend import Backend, BlockStatus
from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.offload.cpu import CPUBackend
from kvtier.offload.disk_manager import DiskBackend, DiskLoadStoreSpec, DiskOffloadingManager
from kvtier.offload.filter import FilterReusedOffloadingManager
from kvtier.offload.mediums import BlockIDsLoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.offload.offloading_stats import OffloadingStats
from kvtier.offload.policies import (
    ARCCachePolicy,
    CachePolicy,
    LRUCachePolicy,
    available_policies,
    get_policy_class,
    register_policy,
)
from kvtier.offload.policy_manager import (
    ARCOffloadingManager,
    CPUOffloadingManager,
    LRUOffloadingManager,
    PolicyOffloadingManager,
)

__all__ = [
    "ARCCachePolicy",
    "ARCOffloadingManager",
    "Backend",
    "BlockIDsLoadStoreSpec",
    "BlockStatus",
    "CPUBackend",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CachePolicy",
    "CascadeOffloadingManager",
    "DiskBackend",
    "DiskLoadStoreSpec",
    "DiskOffloadingManager",
    "FilterReusedOffloadingManager",
    "GPULoadStoreSpec",
    "LRUCachePolicy",
    "LRUOffloadingManager",
    "LoadStoreSpec",
    "OffloadingEvent",
    "OffloadingManager",
    "OffloadingStats",
    "PolicyOffloadingManager",
    "PrepareStoreOutput",
    "available_policies",
    "get_policy_class",
    "register_policy",
]
