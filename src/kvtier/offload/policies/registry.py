"""Cache policies by name.

A built-in policy is one file in this package plus one line in `_BUILTIN` below
(imported on first use, so unused policies cost nothing). A policy from outside
the package is either registered with `register_policy("name", cls)` or named by
module path, "package.module:ClassName".
"""

from __future__ import annotations

import importlib

from kvtier.offload.policies.base import CachePolicy

_BUILTIN: dict[str, str] = {
    "lru": "kvtier.offload.policies.lru:LRUCachePolicy",
    "arc": "kvtier.offload.policies.arc:ARCCachePolicy",
    "reuse": "kvtier.offload.policies.reuse:ReuseCachePolicy",
}

_registered: dict[str, type[CachePolicy]] = {}


def available_policies() -> list[str]:
    """Every name `get_policy_class` accepts (besides "module:Class" paths)."""
    return sorted({*_BUILTIN, *_registered})


def register_policy(name: str, policy_cls: type[CachePolicy]) -> None:
    """Make `policy_cls` available as `name`; a name may be registered once."""
    if not name or ":" in name:
        raise ValueError(f"policy name must be non-empty and without ':', got {name!r}")
    if not (isinstance(policy_cls, type) and issubclass(policy_cls, CachePolicy)):
        raise TypeError(f"policy for {name!r} must be a CachePolicy subclass, got {policy_cls!r}")
    if name in _BUILTIN or name in _registered:
        raise ValueError(f"cache policy {name!r} is already registered")
    _registered[name] = policy_cls


def unregister_policy(name: str) -> None:
    """Forget a policy added with `register_policy` (built-ins cannot be removed)."""
    if name not in _registered:
        raise KeyError(f"no registered cache policy {name!r}; registered: {sorted(_registered)}")
    del _registered[name]


def get_policy_class(name: str) -> type[CachePolicy]:
    """The policy class for a registered name or a "package.module:ClassName" path."""
    if name in _registered:
        return _registered[name]
    path = _BUILTIN.get(name, name)
    if ":" not in path:
        raise ValueError(
            f"unknown cache policy {name!r}; known: {available_policies()} "
            f"(or a 'package.module:ClassName' path)"
        )
    return _load(path)


def create_policy(name: str, cache_capacity: int) -> CachePolicy:
    return get_policy_class(name)(cache_capacity)


def _load(path: str) -> type[CachePolicy]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import cache policy module {module_name!r}: {e}") from e
    policy_cls = getattr(module, attr, None)
    if not (isinstance(policy_cls, type) and issubclass(policy_cls, CachePolicy)):
        raise ValueError(f"{path!r} does not name a CachePolicy subclass (got {policy_cls!r})")
    return policy_cls
