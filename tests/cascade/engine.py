"""A miniature engine driving the cascade and its data plane the way a connector would."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.offload.filter import FilterReusedOffloadingManager
from kvtier.offload.policy_manager import CPUOffloadingManager
from kvtier.store.disk_store import DiskStore
from kvtier.store.layout import KVLayout
from kvtier.store.memory import MemoryStore
from kvtier.transfer.cascade_handler import CascadeHandler, DiskWrite, split_disk_part
from kvtier.transfer.transfer_worker import TransferWorker
from kvtier.types import BlockHash
from tests.transfer.helpers import block_bytes, random_kv

NUM_DEVICE_BLOCKS = 64


class Engine:
    """Device blocks 0..31 hold computed KV; loads land in blocks 32..63."""

    def __init__(
        self,
        layout: KVLayout,
        root: Path,
        *,
        cpu_blocks: int = 4,
        disk_blocks: int = 16,
        disk_writes: str = "demote",
        promote: bool = True,
        disk_filter: bool = False,
        split_writes: bool = False,
    ) -> None:
        """`split_writes`: a store's disk writes (its write-through, its demotion) run
        apart from its copy, as kvtier's vLLM worker runs them."""
        self.kv = random_kv(layout, NUM_DEVICE_BLOCKS, seed=11)
        self.memory = MemoryStore(layout, cpu_blocks, checksums=True)
        self.disk_store = DiskStore(root, layout, DiskStore.capacity_for(layout, disk_blocks))
        disk = self.disk_store.manager(layout.block_size, enable_events=True)
        self.cascade = CascadeOffloadingManager(
            CPUOffloadingManager(layout.block_size, cpu_blocks, enable_events=True),
            FilterReusedOffloadingManager(disk) if disk_filter else disk,
            disk_writes=disk_writes,  # type: ignore[arg-type]
            promote=promote,
            enable_events=True,
        )
        self.handler = CascadeHandler(self.kv, self.memory, self.disk_store)
        self.worker = TransferWorker(self.handler, ordered=True)
        self.expected: dict[BlockHash, bytes] = {}
        self._jobs: dict[int, tuple[str, list[BlockHash]]] = {}
        self._next_job = 0
        self.load_targets: dict[int, list[int]] = {}
        self._next_target = 32
        self.split_writes = split_writes
        self._writes: dict[int, int] = {}  # a split store's write job -> the store's job
        self._writes_only: set[int] = set()  # split stores with no copy left to run
        self._detached: list[int] = []  # loads' demotion writes, no job's
        self._next_detached = 0
        if split_writes:
            self.handler.detach_write = self._detach

    def store(self, hashes: list[BlockHash], device_ids: list[int]) -> list[BlockHash]:
        """prepare_store + submit; returns the hashes being stored."""
        out = self.cascade.prepare_store(hashes)
        if out is None:  # nothing evictable: the engine just does not offload these
            return []
        source = dict(zip(hashes, device_ids, strict=True))
        ids = [source[h] for h in out.block_hashes_to_store]
        for block_hash, device_id in zip(out.block_hashes_to_store, ids, strict=True):
            self.expected[block_hash] = block_bytes(self.kv, device_id)
        self._submit("store", out.block_hashes_to_store, ids, out.store_spec)
        return out.block_hashes_to_store

    def load(self, hashes: list[BlockHash]) -> list[int]:
        """prepare_load + submit into fresh device blocks; returns their ids."""
        spec = self.cascade.prepare_load(hashes)
        targets = [self._fresh() for _ in hashes]
        self.load_targets[self._next_job] = targets
        self._submit("load", hashes, targets, spec)
        return targets

    def _detach(self, write: DiskWrite) -> None:
        """A load's staged demotion, written apart (as kvtier's vLLM worker does)."""
        write_id = -(10**9) - self._next_detached
        self._next_detached += 1
        self._detached.append(write_id)
        self.worker.submit_write(write_id, write)

    def _fresh(self) -> int:
        target = self._next_target
        self._next_target = 32 + (self._next_target - 31) % 32
        return target

    def _submit(self, kind: str, hashes: list[BlockHash], ids: list[int], spec: object) -> None:
        job = self._next_job
        self._next_job += 1
        self._jobs[job] = (kind, hashes)
        split = None
        if kind == "store" and self.split_writes:
            split = split_disk_part(spec, device_apart=True)  # type: ignore[arg-type]
        if split is not None:
            if split.copy is not None:
                self.worker.submit_store(job, ids, split.copy)
            writes = [split.from_slots] if split.from_slots is not None else []
            if split.from_device is not None:
                disk, picked = split.from_device
                rows = self.handler.snapshot(np.asarray([ids[i] for i in picked], dtype=np.int64))
                writes.append((DiskWrite(disk, staged=rows), picked))
            if split.demotion is not None:
                writes.append((split.demotion, []))
            for k, (write, _) in enumerate(writes):
                write_id = -1 - 3 * job - k
                self._writes[write_id] = job
                self.worker.submit_write(write_id, write)
            if split.copy is None:
                self._writes_only.add(job)
        elif kind == "store":
            self.worker.submit_store(job, ids, spec)  # type: ignore[arg-type]
        else:
            demotion = getattr(spec, "demotion", None)
            if self.split_writes and demotion is not None:
                spec = copy.copy(spec)
                spec.demotion_write = DiskWrite(demotion.dst, demotion=demotion)  # type: ignore[attr-defined]
            self.worker.submit_load(job, spec, ids)  # type: ignore[arg-type]

    def results(self, job_ids: list[int]) -> dict[int, bool]:
        """Wait for these jobs (a split store's write too); how each went."""
        writes = [w for w, job in self._writes.items() if job in job_ids]
        self.worker.wait([*(j for j in job_ids if j not in self._writes_only), *writes])
        results: dict[int, bool] = {}
        for job_id, ok, _, _ in self.worker.get_finished():
            if job_id in self._detached:  # a load's demotion, no job's: done on its own
                self._detached.remove(job_id)
                continue
            job_id = self._writes.pop(job_id, job_id)
            results[job_id] = results.get(job_id, True) and ok
        self._writes_only.difference_update(results)
        return results

    def finish(self) -> dict[str, int]:
        """Wait for every job and complete it in the cascade; count outcomes."""
        outcome = {"ok": 0, "failed": 0}
        for job_id, ok in self.results(list(self._jobs)).items():
            kind, hashes = self._jobs.pop(job_id)
            if kind == "store":
                self.cascade.complete_store(hashes, ok)
            else:
                self.cascade.complete_load(hashes, ok)
            outcome["ok" if ok else "failed"] += 1
        lost = self.handler.take_lost()
        if lost:
            self.cascade.discard_disk_blocks(lost)
        return outcome

    def close(self) -> None:
        self.worker.close()
        self.disk_store.close()
