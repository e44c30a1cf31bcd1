"""A tier stack's configuration as a user writes it, checked once for every caller.

The same keys configure an engine (`kv_connector_extra_config`, in bytes) and a replay
(`kvtier replay --vllm-config`), so they are parsed here, into one frozen dataclass,
with one message per mistake naming the key and what it may be. `TierConfig.stack`
turns the byte budgets into block counts for `kvtier.connector.tier_stack`, which builds
the managers; the replay's own flags reach the same `StackConfig`, checked by the same
functions below, so an option the engine takes cannot be refused by the replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from kvtier.connector.cost_model import MODES, Mode
from kvtier.offload.policies import available_policies, get_policy_class
from kvtier.store.diskformat import block_file_bytes
from kvtier.validate import whole_number

DiskWrites = Literal["demote", "write_through"]
DISK_WRITES: tuple[str, ...] = get_args(DiskWrites)


def check_store_threshold(where: str, value: Any) -> int:
    """0 or 1: every block is admitted at once; n >= 2: a block is stored at its n-th offer."""
    return whole_number(where, value, minimum=0)


def check_disk_writes(where: str, value: Any) -> DiskWrites:
    if value not in DISK_WRITES:
        raise ValueError(f"{where} must be 'demote' or 'write_through', got {value!r}")
    mode: DiskWrites = value
    return mode


def check_policy(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a policy name, got {value!r}")
    try:
        get_policy_class(value)
    except (ValueError, TypeError, ImportError, AttributeError) as exc:
        raise ValueError(f"{where}: {exc} (kvtier policies: {available_policies()})") from None
    return value


@dataclass(frozen=True)
class TierConfig:
    """The tiers below the accelerator, as `kv_connector_extra_config` states them (see the
    README's "With vLLM"): budgets in bytes, a disk directory, a Redis URL."""

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
    # the disk directory is shared by several engines (NFS, a cluster file system): blocks
    # kept by KV head under names every parallel layout reads (kvtier.store.shared_disk)
    disk_shared: bool = False
    redis_url: str | None = None
    redis_socket_timeout_s: float = 0.25
    redis_connect_timeout_s: float = 0.25
    redis_ttl_s: int | None = None
    redis_key_prefix: str = "kvt"
    # Redis store jobs in flight at once, each a round trip of its own on its own
    # connection: a Redis across a network sends a job no faster than its round trip,
    # and one at a time a link adding 200 ms sent five store jobs a second
    redis_store_threads: int = 4
    # "measured": offer a tier's hit only where loading it is predicted faster than
    # recomputing it (kvtier.connector.cost_model); "always": every hit is loaded
    load_decision: Mode = "measured"
    # Each tier's queue of stores, in bytes: a store that would take a tier's queue past
    # it is shed (not stored, counted, never an error), so a tier that falls behind
    # holds no more than this of the engine's stores. The local tier's job writes the
    # CPU tier and, with a disk, the disk (the disk's bound is then the local one's).
    cpu_store_queue_bytes: int = 1 << 30
    disk_store_queue_bytes: int = 512 << 20
    redis_store_queue_bytes: int = 512 << 20

    @property
    def has_disk(self) -> bool:
        return self.disk_path is not None

    @property
    def has_redis(self) -> bool:
        return self.redis_url is not None

    def redis_options(self) -> dict[str, Any]:
        """`RemoteTier.from_url` options (RemoteConfig fields) these keys set."""
        return {
            "socket_timeout_s": self.redis_socket_timeout_s,
            "connect_timeout_s": self.redis_connect_timeout_s,
            "ttl_s": self.redis_ttl_s,
            "key_prefix": self.redis_key_prefix,
        }

    def store_queue_bytes(self, local: bool) -> int:
        """The bound of the local tier's (CPU, or CPU and disk) or Redis's store queue."""
        if not local:
            return self.redis_store_queue_bytes
        return self.disk_store_queue_bytes if self.has_disk else self.cpu_store_queue_bytes

    def cpu_blocks(self, bytes_per_block: int) -> int:
        blocks = self.cpu_bytes_to_use // bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"cpu_bytes_to_use {self.cpu_bytes_to_use} is below one block of this model "
                f"({bytes_per_block} bytes)"
            )
        return blocks

    def disk_blocks(self, bytes_per_block: int) -> int:
        """Blocks the disk budget holds, counted in files as the disk tier counts them."""
        if self.disk_bytes_to_use is None:
            return 0
        file_bytes = block_file_bytes(bytes_per_block)
        blocks = self.disk_bytes_to_use // file_bytes
        if blocks < 1:
            raise ValueError(
                f"disk_bytes_to_use {self.disk_bytes_to_use} is below one block file of this "
                f"model ({file_bytes} bytes)"
            )
        return blocks


FIELDS = {f.name: f for f in dataclasses.fields(TierConfig)}
TIER_KEYS = frozenset(FIELDS)


def parse_tier_config(values: Mapping[str, Any], where: str) -> TierConfig:
    """`values` (only TierConfig's keys) as a checked TierConfig; `where` names the dict
    in messages (`kv_connector_extra_config`)."""
    unknown = sorted(set(values) - TIER_KEYS)
    if unknown:
        raise ValueError(f"unknown {where} keys {unknown}; kvtier keys: {sorted(TIER_KEYS)}")
    if values.get("cpu_bytes_to_use") is None:
        raise ValueError(
            f"{where} needs 'cpu_bytes_to_use' (bytes of host memory for kvtier's CPU tier, "
            "e.g. 8000000000)"
        )
    config = TierConfig(**{key: _check(f"{where}[{key!r}]", key, v) for key, v in values.items()})
    _check_combination(config, where)
    return config


def _check(where: str, key: str, value: Any) -> Any:
    if key in ("cpu_bytes_to_use", "disk_bytes_to_use") or key.endswith("_store_queue_bytes"):
        return whole_number(where, value, minimum=1)
    if key == "store_threshold":
        return check_store_threshold(where, value)
    if key in ("disk_io_threads", "redis_ttl_s", "cpu_copy_threads", "redis_store_threads"):
        return whole_number(where, value, minimum=1)
    if key in ("cpu_checksums", "disk_fsync", "disk_shared"):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if key in ("redis_socket_timeout_s", "redis_connect_timeout_s"):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{where} must be a number of seconds > 0, got {value!r}")
        return float(value)
    if key == "disk_writes":
        return check_disk_writes(where, value)
    if key == "eviction_policy":
        return check_policy(where, value)
    if key == "load_decision":
        if value not in MODES:
            allowed = ", ".join(repr(m) for m in MODES)
            raise ValueError(f"{where} must be one of {allowed}, got {value!r}")
        return value
    if not isinstance(value, str) or not value:  # disk_path, redis_url, redis_key_prefix
        raise ValueError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _check_combination(config: TierConfig, where: str) -> None:
    if config.has_disk != (config.disk_bytes_to_use is not None):
        given, missing = (
            ("disk_path", "disk_bytes_to_use")
            if config.has_disk
            else ("disk_bytes_to_use", "disk_path")
        )
        raise ValueError(
            f"{where} has {given!r} but not {missing!r}: the disk tier needs both a "
            "directory and a byte budget"
        )
    if config.disk_shared and not config.has_disk:
        raise ValueError(
            f"{where} has 'disk_shared' but no 'disk_path': a shared disk tier needs the "
            "shared directory (and 'disk_bytes_to_use')"
        )
    if config.redis_url is not None and not config.redis_url.startswith(("redis://", "rediss://")):
        raise ValueError(
            f"{where}['redis_url'] must start with redis:// or rediss://, got a URL with "
            "another scheme"
        )
