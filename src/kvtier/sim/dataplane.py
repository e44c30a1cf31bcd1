"""`--data`: real bytes behind a bookkeeping replay, every loaded block verified.

The replay's decisions are unchanged; on top, each block a request computes is
written into an engine cache (torch tensors, CPU here) with contents derived from
its hash, stores copy those bytes into the CPU tier's host slots through the
transfer worker, and loads copy them back and compare with what the hash says
they must be. A wrong byte anywhere (a slot handed out twice, a copy to the wrong
block, a torn store) shows up as a verification failure; the memory store's own
checksums are counted too. Both must be 0.

The default layout is deliberately small (2 layers, 1 KV head, head size 4,
uint8): the point is to exercise every copy path, not to benchmark bandwidth.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvtier.connector.chain import ChainSpec, TierChain
from kvtier.offload.abstract import LoadStoreSpec, OffloadingManager
from kvtier.sim.metrics import TierCounters, served_tokens
from kvtier.sim.workload import Workload
from kvtier.types import BlockHash

if TYPE_CHECKING:
    from kvtier.store.layout import KVLayout


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
    """An engine cache of `device_blocks`, host slots for the CPU tier, one worker; with
    `disk_blocks`, also a disk store in a temporary directory behind the cascade's worker.
    """

    def __init__(
        self,
        layout: KVLayout,
        device_blocks: int,
        cpu_slots: int,
        disk_blocks: int = 0,
        remote: Any = None,
    ) -> None:
        """`remote`: a `RemoteTier` opened for `layout`; its blocks get their own worker."""
        from kvtier.store.memory import MemoryStore
        from kvtier.transfer.device import DeviceKV, allocate_kv_caches
        from kvtier.transfer.worker import TransferWorker

        self.layout = layout
        self.kv = DeviceKV(layout, allocate_kv_caches(layout, device_blocks))
        self.host = MemoryStore(layout, cpu_slots, checksums=True)
        self.disk_store: Any = None
        self._handler: Any = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.remote = remote
        self._workers: dict[str, Any] = {}
        try:  # a failure half way must not leave worker threads or the directory behind
            if disk_blocks:
                self.worker = self._cascade_worker(disk_blocks)
            else:
                self.worker = TransferWorker.for_store(self.kv, self.host)
            self._workers["cpu"] = self.worker
            if remote is not None:
                store = remote.kv_store(layout)
                self._workers["remote"] = TransferWorker.for_store(self.kv, store)
        except BaseException:
            self.close()
            raise
        self._segments: list[npt.NDArray[np.uint8]] = [s.numpy() for s in self.kv.segments]
        self._job = 0
        # (tier, "stored" | "loaded") -> bytes, as the specs split them between tiers.
        self.moved: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.failed_jobs = 0
        self.verify_failures = 0
        self.verify_failures_by_tier: defaultdict[str, int] = defaultdict(int)

    def _cascade_worker(self, disk_blocks: int) -> Any:
        from kvtier.store.disk import DiskStore
        from kvtier.transfer.cascade import CascadeHandler
        from kvtier.transfer.worker import TransferWorker

        self._tmp = tempfile.TemporaryDirectory(prefix="kvtier-replay-disk-")
        capacity = DiskStore.capacity_for(self.layout, disk_blocks)
        # No fsync: a replay checks that the right bytes come back, not crash durability
        # (the disk tier's own tests do), and an fsync per block would dominate the run.
        self.disk_store = DiskStore(self._tmp.name, self.layout, capacity, fsync=False)
        self._handler = CascadeHandler(self.kv, self.host, self.disk_store)
        return TransferWorker(self._handler, ordered=True)

    def take_lost(self) -> list[BlockHash]:
        """Disk blocks whose demotion failed: the cascade must forget them."""
        return self._handler.take_lost() if self._handler is not None else []

    def _count(self, direction: str, spec: LoadStoreSpec, num_blocks: int, tier: str) -> None:
        """Bytes per tier: a cascade spec says which blocks hit memory and which disk."""
        size = self.layout.bytes_per_block
        disk_positions = getattr(spec, "disk_positions", None)
        if disk_positions is None:
            self.moved[tier, direction] += num_blocks * size
            return
        self.moved["cpu", direction] += len(getattr(spec, "cpu_positions", ())) * size
        self.moved["disk", direction] += len(disk_positions) * size
        promoted = len(getattr(spec, "promotion_positions", ()))
        demotion = getattr(spec, "demotion", None)
        self.moved["cpu", "stored"] += promoted * size
        if demotion is not None:
            self.moved["disk", "stored"] += len(demotion.block_hashes) * size

    def _contents(self, hashes: Sequence[BlockHash], segment: int) -> npt.NDArray[np.uint8]:
        """What the blocks' bytes must be: each hash (and the segment number) repeated."""
        size = self._segments[0].shape[1]
        tag = segment.to_bytes(2, "big")
        seeds = [bytes(h) + tag for h in hashes]
        width = len(seeds[0])
        if any(len(seed) != width for seed in seeds):
            raise ValueError("block hashes of one call must have one length")
        rows = np.frombuffer(b"".join(seeds), dtype=np.uint8).reshape(len(seeds), width)
        return np.tile(rows, (1, -(-size // width)))[:, :size]

    def compute(self, device_ids: Iterable[int], hashes: Sequence[BlockHash]) -> None:
        """The engine's prefill: fill the blocks it computed."""
        ids = list(device_ids)
        if ids:
            for i, seg in enumerate(self._segments):
                seg[ids] = self._contents(hashes, i)

    def _run(self, submit: Any, *args: Any) -> tuple[bool, int]:
        self._job += 1
        job = self._job
        submit(job, *args)
        worker = submit.__self__
        worker.wait([job])
        (result,) = [r for r in worker.get_finished() if r.job_id == job]
        if not result.ok:
            self.failed_jobs += 1
        return result.ok, result.bytes

    def store(self, device_ids: Sequence[int], spec: LoadStoreSpec, tier: str = "cpu") -> bool:
        ok, _ = self._run(self._workers[tier].submit_store, list(device_ids), spec)
        if ok:
            self._count("stored", spec, len(device_ids), tier)
        return ok

    def load(
        self,
        spec: LoadStoreSpec,
        device_ids: Iterable[int],
        hashes: Sequence[BlockHash],
        tier: str = "cpu",
    ) -> bool:
        """Copy the blocks in and verify every byte; False: treat as a miss (recompute)."""
        ids = list(device_ids)
        for seg in self._segments:  # so stale bytes cannot pass for a correct load
            seg[ids] = 0
        ok, _ = self._run(self._workers[tier].submit_load, spec, ids)
        if ok:
            self._count("loaded", spec, len(ids), tier)
        if ok and not self.verify(ids, hashes):
            self.verify_failures_by_tier[tier] += 1
            return False
        return ok

    def verify(self, device_ids: Sequence[int], hashes: Sequence[BlockHash]) -> bool:
        """Do these engine blocks hold exactly what their hashes say? (Counts failures.)"""
        if not device_ids:
            return True
        for i, seg in enumerate(self._segments):
            if not np.array_equal(seg[list(device_ids)], self._contents(hashes, i)):
                self.verify_failures += 1
                return False
        return True

    @property
    def bytes_stored(self) -> int:
        return sum(n for (_, d), n in self.moved.items() if d == "stored")

    @property
    def bytes_loaded(self) -> int:
        return sum(n for (_, d), n in self.moved.items() if d == "loaded")

    def _store_checksum_failures(self) -> dict[str, int]:
        """Checksum failures each tier's store counted itself."""
        return {
            "cpu": self.host.num_checksum_failures,
            "disk": self.disk_store.stats().checksum_failures if self.disk_store is not None else 0,
            "remote": self.remote.stats.corrupt_blocks if self.remote is not None else 0,
        }

    @property
    def checksum_failures(self) -> int:
        return sum(self._store_checksum_failures().values()) + self.verify_failures

    def failures(self, tier: str) -> int:
        """Checksum failures of one tier's store plus wrong bytes it served."""
        own = self._store_checksum_failures().get(tier, 0)
        return own + self.verify_failures_by_tier[tier]

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def data_offload_loop(
    workload: Workload,
    manager: OffloadingManager,
    c: TierCounters,
    dp: DataPlane,
    cascade: Any = None,
) -> tuple[int, int, int, int]:
    """The offload-only replay with bytes: loads verified, failed loads recomputed.

    The engine cache here is a scratch area as large as the longest request: block
    `i` of the request being replayed sits in device block `i`.
    """
    bs = workload.block_size
    resident: set[BlockHash] = set()
    any_hits = prefix_hits = hit_tokens = saved = 0
    for request, hs in zip(workload.requests, workload.block_hashes, strict=True):
        n = len(hs)
        any_hits += len(resident.intersection(hs))
        hit = manager.lookup(hs) or 0
        if hit:
            loaded = hs[:hit]
            ok = _load(dp, manager.prepare_load(loaded), loaded)
            if cascade is not None:  # it settles the promotions the load carried
                cascade.complete_load(loaded, ok)
                _forget_lost(cascade, dp)
            else:
                manager.complete_load(loaded)
            hit = hit if ok else 0  # a failed or corrupt load is a miss: recompute
        prefix_hits += hit
        tokens, saved_tokens = served_tokens(hit, bs, request.input_length)
        hit_tokens += tokens
        saved += saved_tokens
        manager.touch(hs)
        if hit < n:
            dp.compute(range(hit, n), hs[hit:])
            _store(manager, c, dp, hs, hit, resident)
            if cascade is not None:
                _forget_lost(cascade, dp)
    c.bytes_stored, c.bytes_loaded = dp.bytes_stored, dp.bytes_loaded
    c.checksum_failures = dp.checksum_failures
    return any_hits, prefix_hits, hit_tokens, saved


def _load(dp: DataPlane, spec: LoadStoreSpec, loaded: list[BlockHash]) -> bool:
    """Run a load; a chain's spec has one part per tier, in prefix order."""
    if not isinstance(spec, ChainSpec):
        return dp.load(spec, range(len(loaded)), loaded)
    ok, start = True, 0
    for name, part, sub in spec.parts:
        ok = dp.load(sub, range(start, start + len(part)), part, tier=name) and ok
        start += len(part)
    return ok


def _forget_lost(cascade: Any, dp: DataPlane) -> None:
    lost = dp.take_lost()
    if lost:
        cascade.discard_disk_blocks(lost)


def _store(
    manager: OffloadingManager,
    c: TierCounters,
    dp: DataPlane,
    hs: list[BlockHash],
    first: int,
    resident: set[BlockHash],
) -> None:
    out = manager.prepare_store(hs[first:])
    if out is None:
        c.store_rejections += 1
        return
    stored = out.block_hashes_to_store
    position = {h: i for i, h in enumerate(hs)}
    if isinstance(out.store_spec, ChainSpec) and isinstance(manager, TierChain):
        ok = True  # each tier's part is its own job, settled on its own
        for name, part, sub in out.store_spec.parts:
            done = dp.store([position[h] for h in part], sub, tier=name) if part else True
            manager.complete_part(name, part, done)
            ok = ok and done
    else:
        ok = dp.store([position[h] for h in stored], out.store_spec) if stored else True
        manager.complete_store(stored, success=ok)
    c.evictions += len(out.block_hashes_evicted)
    resident.difference_update(out.block_hashes_evicted)
    if ok:
        c.stores += len(stored)
        resident.update(stored)
