"""The curated public surface of `kvtier.offload` (vLLM's names, so code ports by imports)."""

from __future__ import annotations

import subprocess
import sys

import kvtier.offload as offload

VLLM_NAMES = {
    "OffloadingManager",
    "LoadStoreSpec",
    "PrepareStoreOutput",
    "OffloadingEvent",
    "BlockStatus",
    "Backend",
    "CPUBackend",
    "CPULoadStoreSpec",
    "GPULoadStoreSpec",
    "CachePolicy",
    "LRUCachePolicy",
    "ARCCachePolicy",
    "CPUOffloadingManager",
    "LRUOffloadingManager",
    "ARCOffloadingManager",
    "FilterReusedOffloadingManager",
}


def test_all_names_resolve_and_include_vllms() -> None:
    assert set(offload.__all__) >= VLLM_NAMES
    for name in offload.__all__:
        assert getattr(offload, name) is not None


def test_the_scheduler_side_never_imports_torch() -> None:
    code = "import sys, kvtier.offload; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
