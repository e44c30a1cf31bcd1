"""`kv_connector_extra_config` for kvtier's offloading spec, checked at engine start.

vLLM hands a spec its extra config as an untyped dict, and a misspelt key there is
silently ignored by dict lookups until someone wonders why the disk stays empty. So
every key is parsed here once, into one frozen dataclass, and a key that is neither
kvtier's nor one of vLLM's own connector keys stops the engine with a message naming
it and listing what is allowed. This module imports no vLLM: it is tested alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.offload.policies import available_policies, get_policy_class

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

DiskWrites = Literal["demote", "write_through"]


@dataclass(frozen=True)
class KvtierVllmConfig:
    """kvtier's part of `kv_connector_extra_config` (see the README's "With vLLM")."""

    cpu_bytes_to_use: int
    eviction_policy: str = "lru"
    store_threshold: int = 0
    cpu_checksums: bool = False
    cpu_copy_threads: int = 2
    disk_path: str | None = None
    disk_bytes_to_use: int | None = None
    # every CPU store also written to disk: a restart (after any shutdown, even a kill)
    # finds the CPU tier's blocks; measured in benchmarks/bench_disk_writes.py (README)
    disk_writes: DiskWrites = "write_through"
    disk_fsync: bool = True
    disk_io_threads: int = 2
    redis_url: str | None = None
    redis_socket_timeout_s: float = 0.25
    redis_connect_timeout_s: float = 0.25
    redis_ttl_s: int | None = None
    redis_key_prefix: str = "kvt"

    @property
    def has_disk(self) -> bool:
        return self.disk_path is not None

    @property
    def has_redis(self) -> bool:
        return self.redis_url is not None


_FIELDS = {f.name: f for f in dataclasses.fields(KvtierVllmConfig)}
KVTIER_KEYS = frozenset(_FIELDS)


def parse_extra_config(extra: Mapping[str, Any]) -> KvtierVllmConfig:
    """The kvtier config in `extra`, or a ValueError naming the first bad key."""
    for key in extra:
        if key in NOT_APPLICABLE:
            raise ValueError(
                f"kv_connector_extra_config key {key!r} does not apply to "
                f"KvtierOffloadingSpec: {NOT_APPLICABLE[key]}"
            )
        if key not in KVTIER_KEYS and key not in VLLM_KEYS:
            raise ValueError(
                f"unknown kv_connector_extra_config key {key!r} for KvtierOffloadingSpec; "
                f"kvtier keys: {sorted(KVTIER_KEYS)}; vLLM connector keys: {sorted(VLLM_KEYS)}"
            )
    if extra.get("cpu_bytes_to_use") is None:
        raise ValueError(
            "kv_connector_extra_config needs 'cpu_bytes_to_use' (bytes of host memory for "
            "kvtier's CPU tier, e.g. 8000000000)"
        )
    values = {key: _check(key, extra[key]) for key in extra if key in KVTIER_KEYS}
    config = KvtierVllmConfig(**values)
    _check_combination(config)
    return config


def _check(key: str, value: Any) -> Any:
    where = f"kv_connector_extra_config[{key!r}]"
    if key in ("cpu_bytes_to_use", "disk_bytes_to_use"):
        return _integer(where, value, minimum=1)
    if key in ("store_threshold", "disk_io_threads", "redis_ttl_s", "cpu_copy_threads"):
        return _integer(where, value, minimum=1 if key != "store_threshold" else 0)
    if key in ("cpu_checksums", "disk_fsync"):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if key in ("redis_socket_timeout_s", "redis_connect_timeout_s"):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{where} must be a number of seconds > 0, got {value!r}")
        return float(value)
    if key == "disk_writes":
        if value not in ("demote", "write_through"):
            raise ValueError(f"{where} must be 'demote' or 'write_through', got {value!r}")
        return value
    if key == "eviction_policy":
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a policy name, got {value!r}")
        try:
            get_policy_class(value)
        except (ValueError, TypeError, ImportError, AttributeError) as exc:
            raise ValueError(f"{where}: {exc} (kvtier policies: {available_policies()})") from None
        return value
    if not isinstance(value, str) or not value:  # disk_path, redis_url, redis_key_prefix
        raise ValueError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _integer(where: str, value: Any, minimum: int) -> int:
    """An int >= minimum; a float with no fraction is accepted (JSON writes 8e9 so)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_combination(config: KvtierVllmConfig) -> None:
    if config.has_disk != (config.disk_bytes_to_use is not None):
        given, missing = (
            ("disk_path", "disk_bytes_to_use")
            if config.has_disk
            else ("disk_bytes_to_use", "disk_path")
        )
        raise ValueError(
            f"kv_connector_extra_config has {given!r} but not {missing!r}: the disk tier "
            "needs both a directory and a byte budget"
        )
    if config.redis_url is not None and not config.redis_url.startswith(("redis://", "rediss://")):
        raise ValueError(
            "kv_connector_extra_config['redis_url'] must start with redis:// or rediss://, "
            "got a URL with another scheme"
        )


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
