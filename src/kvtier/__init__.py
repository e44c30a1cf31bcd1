"""kvtier: a tiered KV-cache manager for LLM serving.

The public surface is imported lazily so that `import kvtier` stays cheap for
tools that only need hashing or the offload bookkeeping (no torch, no redis).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "KVCacheManager": "kvtier.gpu.kv_cache_manager",
    "Request": "kvtier.request",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from kvtier.gpu.kv_cache_manager import KVCacheManager as KVCacheManager
    from kvtier.request import Request as Request


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
