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
from kvtier.offload.cascade import CascadeOffloadingManager
from kvtier.offload.counters import OffloadingCounters
from kvtier.offload.cpu import CPUBackend
from kvtier.offload.disk import DiskBackend, DiskLoadStoreSpec, DiskOffloadingManager
from kvtier.offload.filter import FilterReusedOffloadingManager
from kvtier.offload.manager import (
    ARCOffloadingManager,
    CPUOffloadingManager,
    LRUOffloadingManager,
    PolicyOffloadingManager,
)
from kvtier.offload.mediums import BlockIDsLoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.offload.policies import (
    ARCCachePolicy,
    CachePolicy,
    LRUCachePolicy,
    available_policies,
    get_policy_class,
    register_policy,
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
    "OffloadingCounters",
    "OffloadingEvent",
    "OffloadingManager",
    "PolicyOffloadingManager",
    "PrepareStoreOutput",
    "available_policies",
    "get_policy_class",
    "register_policy",
]
