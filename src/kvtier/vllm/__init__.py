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
_EXPORTS: dict[str, str] = {}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    submodule = _EXPORTS.get(name)
    if submodule is None:
        raise AttributeError(
            f"module 'kvtier.vllm' has no attribute {name!r}; it exports {sorted(_EXPORTS)}"
        )
    return getattr(importlib.import_module(f"kvtier.vllm.{submodule}"), name)
