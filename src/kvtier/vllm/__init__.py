"""The adapters vLLM loads from outside its tree, one subpackage per way in:
`offloading` (kvtier's own spec and connector), `cpu_policies` (kvtier's policies in
vLLM's CPU tier), `tiering` (kvtier's tiers under vLLM's tiering spec); `engines` runs
real engines for the demo, the benchmarks and the tests; `version` is shared.

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
    "KvtierConnector": "offloading.kvtier_connector",
    "KvtierDiskTier": "tiering.secondary_tiers",
    "KvtierOffloadingSpec": "offloading.offloading_spec",
    "KvtierRedisTier": "tiering.secondary_tiers",
    "KvtierTieringOffloadingSpec": "tiering.tiering_spec",
    "transfer_config": "offloading.extra_config",
}
# name prefix -> the submodule that makes those names on demand (one vLLM cache policy
# per policy in kvtier's registry, "kvtier_lru", "kvtier_arc", ...: see cache_policies)
_PREFIXES: dict[str, str] = {"kvtier_": "cpu_policies.cache_policies"}

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
