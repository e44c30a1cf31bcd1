"""What one replay is asked to do: tiers, capacities, policy, clock and bytes.

This module is the vocabulary every other part of the replay imports (and imports
nothing of the replay itself), so the package has no import circle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.connector.scheduler import StoreOn
from kvtier.connector.tier_config import DiskWrites, check_disk_writes, check_store_threshold
from kvtier.connector.tier_stack import StackConfig
from kvtier.sim.store_queues import StoreQueueModel
from kvtier.sim.workload import Workload

Progress = Callable[[int], None]
# Requests between two progress callbacks: often enough for a smooth bar, rare
# enough to cost nothing in the loop.
PROGRESS_EVERY = 512
# Where a replay with real bytes keeps its disk tier without `disk_dir` (a temporary
# directory; `kvtier replay` reclaims ones a killed run left).
REPLAY_DISK_PREFIX = "kvtier-replay-disk-"


@dataclass(frozen=True)
class TimeModel:
    """Prefill cost: a fixed overhead plus uncached tokens at a prefill rate.

    Loading an offloaded block is taken to cost `load_ms_per_block` (the transfer is
    overlapped with nothing, a pessimistic but simple choice). Decode time is
    `output_length / decode_tokens_per_s`; it matters only to the accelerator tier,
    whose blocks a request holds until it finishes.
    """

    prefill_tokens_per_s: float = 20_000.0
    prefill_overhead_ms: float = 5.0
    load_ms_per_block: float = 0.05
    decode_tokens_per_s: float = 40.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_tokens_per_s <= 0:
            raise ValueError(
                "token rates must be > 0, got "
                f"{self.prefill_tokens_per_s} and {self.decode_tokens_per_s}"
            )
        if self.prefill_overhead_ms < 0 or self.load_ms_per_block < 0:
            raise ValueError("times must be >= 0")

    def prefill_ms(self, uncached_tokens: int, loaded_blocks: int) -> float:
        return (
            self.prefill_overhead_ms
            + 1000.0 * uncached_tokens / self.prefill_tokens_per_s
            + self.load_ms_per_block * loaded_blocks
        )

    def decode_ms(self, output_tokens: int) -> float:
        return 1000.0 * output_tokens / self.decode_tokens_per_s


@dataclass(frozen=True)
class ReplayConfig:
    """One replay: tiers, their capacities and policy, and the admission filter."""

    policy: str = "lru"
    # CPU tier size in blocks, or as a fraction of the trace's unique blocks.
    cpu_blocks: int | None = None
    cpu_frac: float | None = None
    gpu_blocks: int = 0
    # Reuse filter: store a block only once seen this many times (0 or 1: no filter).
    store_threshold: int = 0
    # Overlap requests by arrival time (in-flight loads, waiting for room); None:
    # every completion lands at once.
    time_model: TimeModel | None = None
    # With an accelerator tier: store blocks to the CPU tier once computed (vLLM)
    # or only when the accelerator evicts them.
    store_on: StoreOn = "compute"
    # A local disk tier below the CPU tier (the cascade: demotion on CPU eviction).
    disk_blocks: int = 0
    # Write to disk when the CPU tier evicts a block ("demote") or at every CPU store.
    disk_writes: DiskWrites = "demote"
    # Keep the disk tier's files here across runs (needs data=True); None: a
    # temporary directory, removed after the replay.
    disk_dir: str | None = None
    # A shared Redis tier below the CPU tier (write-through, promotion on load).
    redis_url: str | None = None
    # Key namespace in Redis; None: a fresh one per replay (runs never share blocks).
    redis_namespace: str | None = None
    # RemoteConfig options for the Redis tier (timeouts, ttl_s, key_prefix: an engine's).
    redis_options: Mapping[str, Any] = field(default_factory=dict)
    # Move real bytes through every tier and verify every load.
    data: bool = False
    # Placeholder bytes written per block without a data plane (Redis memory and
    # traffic then behave as with real blocks of that size).
    remote_payload_bytes: int = 256
    # Each tier member's store queue (write time per block, bound): a tier that falls
    # behind sheds stores, as an engine's does (needs time_model); None: never shed.
    store_queues: StoreQueueModel | None = None

    def __post_init__(self) -> None:
        if self.cpu_blocks is not None and self.cpu_frac is not None:
            raise ValueError("give cpu_blocks or cpu_frac, not both")
        if self.cpu_blocks is not None and self.cpu_blocks < 0:
            raise ValueError(f"cpu_blocks must be >= 0, got {self.cpu_blocks}")
        if self.cpu_frac is not None and not 0 < self.cpu_frac <= 1:
            raise ValueError(f"cpu_frac must be in (0, 1], got {self.cpu_frac}")
        if self.store_on not in ("compute", "evict"):
            raise ValueError(f"store_on must be 'compute' or 'evict', got {self.store_on!r}")
        if self.data and self.store_on == "evict":
            raise ValueError("data=True needs store_on='compute' (evicted blocks' bytes are gone)")
        if self.disk_blocks < 0:
            raise ValueError(f"disk_blocks must be >= 0, got {self.disk_blocks}")
        if self.disk_dir is not None and not (self.data and self.disk_blocks):
            raise ValueError(
                "disk_dir keeps real block files: it needs data=True and disk_blocks > 0"
            )
        if self.gpu_blocks < 0:
            raise ValueError(f"gpu_blocks must be >= 0, got {self.gpu_blocks}")
        check_store_threshold("store_threshold", self.store_threshold)
        if self.store_queues is not None and self.time_model is None:
            raise ValueError(
                "store_queues drain in the replay's virtual time: they need time_model "
                "(--concurrent)"
            )
        check_disk_writes("disk_writes", self.disk_writes)

    def cpu_capacity(self, workload: Workload) -> int:
        """Blocks in the CPU tier; the default is 5% of the unique blocks."""
        if self.cpu_blocks is not None:
            return self.cpu_blocks
        frac = 0.05 if self.cpu_frac is None else self.cpu_frac
        return max(1, int(workload.unique_blocks * frac))

    def stack_config(self, workload: Workload) -> StackConfig:
        """The tiers to build, as kvtier's one builder takes them."""
        return StackConfig(
            block_size=workload.block_size,
            cpu_blocks=self.cpu_capacity(workload),
            policy=self.policy,
            store_threshold=self.store_threshold,
            disk_blocks=self.disk_blocks,
            disk_writes=self.disk_writes,
            redis_url=self.redis_url,
            redis_options=self.redis_options,
        )

    def total_capacity(self, workload: Workload) -> int:
        """Blocks all tiers hold together; a remote tier is taken as unbounded (every
        unique block fits: Redis evicts on its own terms, which the replay cannot see)."""
        remote = workload.unique_blocks if self.redis_url else 0
        return self.gpu_blocks + self.cpu_capacity(workload) + self.disk_blocks + remote

    def bound_assumptions(self) -> tuple[str, ...]:
        """What the bounds take for granted that this configuration may not honour."""
        notes = []
        if self.redis_url:
            notes.append("the Redis tier is counted as unbounded (it holds every unique block)")
            if self.redis_namespace is not None:
                notes.append(
                    f"every tier starts empty, but namespace {self.redis_namespace!r} is "
                    "shared: blocks earlier runs left there can beat both bounds"
                )
        if self.disk_dir is not None:
            notes.append(
                "every tier starts empty, but the disk tier reopens its directory: "
                "blocks recovered from earlier runs can beat both bounds"
            )
        return tuple(notes)
