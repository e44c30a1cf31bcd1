"""`kv_connector_extra_config` for kvtier's offloading spec, checked at engine start.

vLLM hands a spec its extra config as an untyped dict, and a misspelt key there is
silently ignored by dict lookups until someone wonders why the disk stays empty. So
every key is parsed once, into one frozen `TierConfig` (the replay's `--vllm-config`
reads the same keys with the same checks), and a key that is neither kvtier's nor one
of vLLM's own connector keys stops the engine with a message naming it and listing
what is allowed. This module imports no vLLM: it is tested alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.connector.tier_config import TIER_KEYS, TierConfig, parse_tier_config

# Keys vLLM's OffloadingConnector itself reads from the same dict; they are vLLM's
# business and pass through untouched.
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "offload_prompt_only",
        "self_describing_kv_events",
        "canonical_layout",
        "enable_telemetry",
    }
)
# vLLM keys that configure vLLM's own CPU manager or tiering spec, which kvtier's
# spec replaces: accepting them silently would suggest they do something.
NOT_APPLICABLE = {
    "cache_policy_module_path": "use eviction_policy with a kvtier policy name or "
    "'package.module:Class' (vLLM's cache_policy_module_path configures vLLM's own "
    "CPUOffloadingSpec, see kvtier.vllm's cache policies)",
    "max_tracker_size": "kvtier's store_threshold filter sizes its own history",
    "secondary_tiers": "kvtier's tiers are configured with disk_path and redis_url "
    "(secondary_tiers belongs to vLLM's TieringOffloadingSpec)",
    "backpressure": "kvtier's transfer workers bound their own queues",
}


def parse_extra_config(extra: Mapping[str, Any]) -> TierConfig:
    """The kvtier config in `extra`, or a ValueError naming the first bad key."""
    for key in extra:
        if key in NOT_APPLICABLE:
            raise ValueError(
                f"kv_connector_extra_config key {key!r} does not apply to "
                f"KvtierOffloadingSpec: {NOT_APPLICABLE[key]}"
            )
        if key not in TIER_KEYS and key not in VLLM_KEYS:
            raise ValueError(
                f"unknown kv_connector_extra_config key {key!r} for KvtierOffloadingSpec; "
                f"kvtier keys: {sorted(TIER_KEYS)}; vLLM connector keys: {sorted(VLLM_KEYS)}"
            )
    values = {key: value for key, value in extra.items() if key in TIER_KEYS}
    return parse_tier_config(values, "kv_connector_extra_config")


def transfer_config(**extra_config: Any) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` that turns kvtier on, with these extra-config keys.

    `LLM(model, kv_transfer_config=transfer_config(cpu_bytes_to_use=8_000_000_000))`, or
    the same dict as JSON after `vllm serve --kv-transfer-config`. The keys are checked
    here already, so a typo fails before an engine starts.
    """
    extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm"}
    extra |= extra_config
    parse_extra_config(extra)
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
