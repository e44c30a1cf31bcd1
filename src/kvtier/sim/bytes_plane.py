"""The replay's bytes plane: none (bookkeeping only), or real bytes that can fail.

With real bytes (`--data`), each block a request computes is written into an engine
cache (torch tensors, CPU here) with contents derived from its hash; stores copy
those bytes into the tiers through their transfer workers (the CPU tier's host
slots, the cascade's disk files, Redis values), and loads copy them back and compare
every byte with what the hash says it must be. A wrong byte anywhere (a slot handed
out twice, a copy to the wrong block, a torn store, a corrupt file) fails the load,
which the replay then treats as a miss; the stores' own checksums are counted too.

Every outcome goes to the `Ledger`: bytes per tier for transfers that succeeded, an
error per transfer that failed (a demotion that never reached the disk included),
checksum failures per tier. Transfers run synchronously, one job at a time, in
the order the replay plans them (which the cascade's demotions rely on); the
replay's clock decides only when their completions are reported to the tiers.

The default layout is deliberately small (2 layers, 1 KV head, head size 4,
uint8): the point is to exercise every copy path, not to benchmark bandwidth.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvtier.connector.chain import ChainSpec
from kvtier.offload.abstract import LoadStoreSpec
from kvtier.offload.cascade_manager import CascadeLoadSpec, CascadeStoreSpec
from kvtier.sim.ledger import Ledger
from kvtier.sim.stack import LOCAL, REMOTE, TierStack
from kvtier.types import BlockHash

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from kvtier.store.layout import KVLayout
    from kvtier.transfer.cascade_handler import CascadeHandler
    from kvtier.transfer.transfer_worker import TransferWorker

# One chain member's share of a transfer: (member name, its block hashes, its spec).
Part = tuple[str, list[BlockHash], LoadStoreSpec]


class BytesPlane(Protocol):
    """What the replay's step asks of the bytes under it."""

    def compute(self, device_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None: ...

    def verify(self, device_ids: Sequence[int], hashes: Sequence[BlockHash]) -> bool: ...

    def load(self, spec: LoadStoreSpec, device_ids: Sequence[int], hashes: list[BlockHash]) -> bool:
        """Bring the blocks in; False: they did not all arrive intact (recompute)."""
        ...

    def store(
        self, spec: LoadStoreSpec, device_ids: Sequence[int], hashes: list[BlockHash]
    ) -> list[tuple[str, bool]]:
        """Write the blocks; each tier's part succeeds or fails on its own."""
        ...

    def unreadable(self, disk_hashes: list[BlockHash]) -> set[BlockHash]:
        """Those of these disk blocks whose files would not load (missing or corrupt)."""
        ...

    def take_lost(self) -> list[BlockHash]: ...

    def close(self) -> None: ...


def parts_of(spec: LoadStoreSpec, hashes: list[BlockHash]) -> list[Part]:
    """A chain's spec has one part per member ("local", "remote"), in prefix order;
    any other spec is the local member's (the CPU tier or the cascade)."""
    if isinstance(spec, ChainSpec):
        return [(name, part, sub) for name, part, sub in spec.parts]
    return [(LOCAL, hashes, spec)]


def position_tiers(spec: LoadStoreSpec, num_blocks: int) -> list[str]:
    """The tier each block of a load comes from, by its spec's medium (a chain's spec
    by its parts', the cascade's by its positions)."""
    if isinstance(spec, ChainSpec):
        return [t for _, part, sub in spec.parts for t in position_tiers(sub, len(part))]
    if isinstance(spec, CascadeLoadSpec):
        tiers = ["cpu"] * num_blocks
        for p in spec.disk_positions:
            tiers[p] = "disk"
        return tiers
    return [spec.medium().lower()] * num_blocks


class NoBytes:
    """Bookkeeping only: every transfer succeeds, nothing is copied."""

    def compute(self, device_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        pass

    def verify(self, device_ids: Sequence[int], hashes: Sequence[BlockHash]) -> bool:
        return True

    def load(self, spec: LoadStoreSpec, device_ids: Sequence[int], hashes: list[BlockHash]) -> bool:
        return True

    def store(
        self, spec: LoadStoreSpec, device_ids: Sequence[int], hashes: list[BlockHash]
    ) -> list[tuple[str, bool]]:
        return [(name, True) for name, _, _ in parts_of(spec, hashes)]

    def unreadable(self, disk_hashes: list[BlockHash]) -> set[BlockHash]:
        return set()

    def take_lost(self) -> list[BlockHash]:
        return []

    def close(self) -> None:
        pass


def small_layout(block_size: int, model_id: str = "kvtier-replay") -> KVLayout:
    """`model_id` is part of the fingerprint, so it also namespaces blocks in Redis."""
    from kvtier.store.layout import KVLayout

    return KVLayout(
        num_layers=2,
        num_kv_heads=1,
        head_size=4,
        block_size=block_size,
        dtype="uint8",
        model_id=model_id,
    )


class DataPlane:
    """An engine cache of `device_blocks`, host slots for the CPU tier, and one transfer
    worker per tier stack part: the CPU tier (or the cascade, with the stack's disk
    store) and the remote tier."""

    def __init__(
        self, layout: KVLayout, device_blocks: int, stack: TierStack, ledger: Ledger
    ) -> None:
        from kvtier.store.memory import MemoryStore
        from kvtier.transfer.cascade_handler import CascadeHandler
        from kvtier.transfer.device import DeviceKV, allocate_kv_caches
        from kvtier.transfer.transfer_worker import TransferWorker

        self.layout = layout
        self.ledger = ledger
        self.stack = stack
        self.kv = DeviceKV(layout, allocate_kv_caches(layout, max(1, device_blocks)))
        self.host = MemoryStore(layout, max(1, stack.capacities["cpu"]), checksums=True)
        self._cascade: CascadeHandler | None = None
        self._workers: dict[str, TransferWorker] = {}
        try:  # a failure half way must not leave worker threads behind
            if stack.disk_store is not None:
                self._cascade = CascadeHandler(self.kv, self.host, stack.disk_store)
                self._workers[LOCAL] = TransferWorker(self._cascade, ordered=True)
            else:
                self._workers[LOCAL] = TransferWorker.for_store(self.kv, self.host)
            if stack.remote is not None:
                remote = stack.remote.kv_store(layout)
                self._workers[REMOTE] = TransferWorker.for_store(self.kv, remote)
        except BaseException:
            self.close()
            raise
        self._segments: list[npt.NDArray[np.uint8]] = [s.numpy() for s in self.kv.segments]
        self._job_ids = itertools.count(1)
        self._size = layout.bytes_per_block
        self._checksums_seen = dict.fromkeys(("cpu", "disk"), 0)

    # --- contents -------------------------------------------------------------------

    def _contents(self, hashes: Sequence[BlockHash], segment: int) -> npt.NDArray[np.uint8]:
        """What the blocks' bytes must be: each hash (and the segment number) repeated."""
        import numpy as np

        size = self._segments[0].shape[1]
        tag = segment.to_bytes(2, "big")
        seeds = [bytes(h) + tag for h in hashes]
        width = len(seeds[0])
        if any(len(seed) != width for seed in seeds):
            raise ValueError("block hashes of one call must have one length")
        rows = np.frombuffer(b"".join(seeds), dtype=np.uint8).reshape(len(seeds), width)
        return np.tile(rows, (1, -(-size // width)))[:, :size]

    def compute(self, device_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """The engine's prefill: fill the blocks it computed."""
        ids = list(device_ids)
        if ids:
            for i, seg in enumerate(self._segments):
                seg[ids] = self._contents(hashes, i)

    def _wrong_rows(self, device_ids: Sequence[int], hashes: Sequence[BlockHash]) -> set[int]:
        import numpy as np

        bad: set[int] = set()
        ids = list(device_ids)
        for i, seg in enumerate(self._segments):
            equal = (seg[ids] == self._contents(hashes, i)).all(axis=1)
            bad.update(np.flatnonzero(~equal).tolist())
        return bad

    def verify(self, device_ids: Sequence[int], hashes: Sequence[BlockHash]) -> bool:
        """Do these engine blocks hold exactly what their hashes say?"""
        return not device_ids or not self._wrong_rows(device_ids, hashes)

    # --- transfers ------------------------------------------------------------------

    def _run(self, member: str, direction: str, spec: LoadStoreSpec, ids: list[int]) -> bool:
        """One job on the chain member's worker, waited for; a failure is its tier's error."""
        worker = self._workers[member]
        job = next(self._job_ids)
        calls_failed = self._remote_call_failures()
        demotions = self._failed_demotions()
        if direction == "store":
            worker.submit_store(job, ids, spec)
        else:
            worker.submit_load(job, spec, ids)
        worker.wait([job])
        (result,) = [r for r in worker.get_finished() if r.job_id == job]
        failed_demotions = self._failed_demotions()
        if failed_demotions[0] > demotions[0]:  # its job went on: the disk's store failed
            self.ledger.store_failed("disk", failed_demotions[1] - demotions[1])
        if not result.ok:
            if member == REMOTE:
                # A failed server call is counted by the remote tier's own statistics.
                if self._remote_call_failures() == calls_failed:
                    self.ledger.failed("remote")
            else:
                self.ledger.failed(_faulty_local_tier(spec))
        if result.ok:
            moved = "stored" if direction == "store" else "loaded"
            self._count(moved, member, spec, len(ids), failed_demotions[0] > demotions[0])
        return result.ok

    def _count(
        self,
        direction: str,
        member: str,
        spec: LoadStoreSpec,
        num_blocks: int,
        demotion_failed: bool,
    ) -> None:
        """Bytes per tier of a successful job (the remote tier counts its own)."""
        if member == REMOTE:
            return
        size, moved = self._size, self.ledger.moved
        if isinstance(spec, CascadeStoreSpec | CascadeLoadSpec):
            moved("cpu", direction, len(spec.cpu_positions) * size)
            moved("disk", direction, len(spec.disk_positions) * size)
            if spec.demotion is not None and not demotion_failed:
                moved("disk", "stored", len(spec.demotion.block_hashes) * size)
            if isinstance(spec, CascadeLoadSpec):
                moved("cpu", "stored", len(spec.promotion_positions) * size)
            return
        moved(spec.medium().lower(), direction, num_blocks * size)

    def load(self, spec: LoadStoreSpec, device_ids: Sequence[int], hashes: list[BlockHash]) -> bool:
        ids = list(device_ids)
        for seg in self._segments:  # so stale bytes cannot pass for a correct load
            seg[ids] = 0
        ok, start = True, 0
        for name, part, sub in parts_of(spec, hashes):
            part_ids = ids[start : start + len(part)]
            ok = self._run(name, "load", sub, part_ids) and ok
            start += len(part)
        if not ok:
            return False
        wrong = self._wrong_rows(ids, hashes)
        if wrong:
            tiers = position_tiers(spec, len(hashes))
            for tier in {tiers[row] for row in wrong}:
                self.ledger.checksum_failed(tier)
                self.ledger.failed(tier)
            return False
        return True

    def store(
        self, spec: LoadStoreSpec, device_ids: Sequence[int], hashes: list[BlockHash]
    ) -> list[tuple[str, bool]]:
        position = dict(zip(hashes, device_ids, strict=True))
        done = []
        for name, part, sub in parts_of(spec, hashes):
            ok = self._run(name, "store", sub, [position[h] for h in part]) if part else True
            done.append((name, ok))
        return done

    # --- faults the tiers report --------------------------------------------------------

    def _failed_demotions(self) -> tuple[int, int]:
        c = self._cascade
        return (c.failed_demotions, c.failed_demotion_blocks) if c is not None else (0, 0)

    def _remote_call_failures(self) -> int:
        remote = self.stack.remote
        if remote is None:
            return 0
        stats = remote.stats
        return stats.errors + stats.skipped_calls

    def unreadable(self, disk_hashes: list[BlockHash]) -> set[BlockHash]:
        """Read each block's file and check it, as a load would (a bad one is dropped by
        the store and reported by `take_lost`); nothing reaches the engine."""
        from kvtier.store.protocol import BlockLoadError

        store = self.stack.disk_store
        if store is None or not disk_hashes:
            return set()
        scratch = memoryview(bytearray(self._size))
        bad = set()
        for block_hash in disk_hashes:
            try:
                store.read([block_hash], [scratch])
            except BlockLoadError:
                bad.add(block_hash)
        return bad

    def take_lost(self) -> list[BlockHash]:
        """Disk blocks whose demotion failed or whose file was found corrupt or missing."""
        return self._cascade.take_lost() if self._cascade is not None else []

    def take_checksum_failures(self) -> None:
        """Checksum failures the local stores counted themselves, into the ledger."""
        counts = {"cpu": self.host.num_checksum_failures}
        if self.stack.disk_store is not None:
            counts["disk"] = self.stack.disk_store.stats().checksum_failures
        for tier, count in counts.items():
            self.ledger.checksum_failed(tier, count - self._checksums_seen[tier])
            self._checksums_seen[tier] = count

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()


def _faulty_local_tier(spec: LoadStoreSpec) -> str:
    """A failed cascade job is the disk's when it touched the disk (memory copies
    between the engine and host slots do not fail on their own)."""
    if isinstance(spec, CascadeStoreSpec | CascadeLoadSpec) and (
        spec.disk_positions or spec.demotion is not None
    ):
        return "disk"
    return "cpu"
