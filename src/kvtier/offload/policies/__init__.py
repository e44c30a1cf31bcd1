"""Cache policies: ordering and victim choice for one offload tier."""

from kvtier.offload.policies.arc import ARCCachePolicy
from kvtier.offload.policies.base import CachePolicy
from kvtier.offload.policies.lru import LRUCachePolicy
from kvtier.offload.policies.registry import (
    available_policies,
    create_policy,
    get_policy_class,
    register_policy,
    unregister_policy,
)

__all__ = [
    "ARCCachePolicy",
    "CachePolicy",
    "LRUCachePolicy",
    "available_policies",
    "create_policy",
    "get_policy_class",
    "register_policy",
    "unregister_policy",
]
