"""The adapters vLLM loads from outside its tree.

vLLM finds each class by a module path and a name (`spec_module_path`,
`cache_policy_module_path`, a secondary tier's `module_path`, all `"kvtier.vllm"`), so
every class it may load is exported here. Names resolve lazily: `import kvtier.vllm`
does not import vLLM (only the submodules do), so the rest of kvtier and its tests run
without it, and a missing or unsupported vLLM is reported when a class is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

# exported name -> the submodule of kvtier.vllm that defines it
_EXPORTS: dict[str, str] = {
    "KvtierConnector": "connector",
    "KvtierDiskTier": "secondary_tiers",
    "KvtierOffloadingSpec": "spec",
    "KvtierRedisTier": "secondary_tiers",
    "KvtierTieringOffloadingSpec": "secondary_tiers_spec",
    "transfer_config": "extra_config",
}
# name prefix -> the submodule that makes those names on demand (one vLLM cache policy
# per policy in kvtier's registry, "kvtier_lru", "kvtier_arc", ...: see cache_policies)
_PREFIXES: dict[str, str] = {"kvtier_": "cache_policies"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    submodule = _EXPORTS.get(name)
    if submodule is None:
        submodule = next((m for p, m in _PREFIXES.items() if name.startswith(p)), None)
    if submodule is None:
        raise AttributeError(
            f"module 'kvtier.vllm' has no attribute {name!r}; it exports {sorted(_EXPORTS)}"
        )
    return getattr(importlib.import_module(f"kvtier.vllm.{submodule}"), name)
