"""What the worker asks of a job's parts (`job_specs.Part`): the CPU slots a part fills,
the blocks it holds in its tier's queue, whether and where it writes the disk, the tier
its time is measured under; and the parts it cuts from them (a remote store's subpart,
a part with a spec of its own). Pure functions of the specs the scheduler side built:
the worker's state stays in `kvtier_worker`."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from kvtier.offload.cascade_manager import CascadeLoadSpec, CascadeStoreSpec
from kvtier.offload.mediums import BlockIDsLoadStoreSpec
from kvtier.remote.remote_manager import RemoteLoadStoreSpec
from kvtier.transfer.cascade_handler import CopyThenWrite, DiskWrite, split_disk_part
from kvtier.types import BlockHash
from kvtier.vllm.offloading.job_specs import LOCAL, REMOTE, Part


def slots_of(part: Part) -> list[tuple[int, BlockHash]]:
    """(CPU slot, block) for each block this local part writes into the CPU tier."""
    spec = part.spec
    if isinstance(spec, CascadeStoreSpec) and spec.cpu is not None:
        slots, positions = spec.cpu.block_ids, spec.cpu_positions
    elif isinstance(spec, CascadeLoadSpec) and spec.promotion is not None:
        slots, positions = spec.promotion.block_ids, spec.promotion_positions
    else:
        return []
    hashes = part.block_hashes
    return [(slot, hashes[p]) for slot, p in zip(slots.tolist(), positions, strict=True)]


def cpu_slots(subs: list[tuple[int, Part]]) -> dict[int, tuple[int, int]]:
    """Job position -> (the local part's sub, the CPU slot it writes there)."""
    out: dict[int, tuple[int, int]] = {}
    for sub, part in subs:
        spec = part.spec
        if isinstance(spec, CascadeStoreSpec) and spec.cpu is not None:
            slots, positions = spec.cpu.block_ids, [part.positions[i] for i in spec.cpu_positions]
        elif part.tier == LOCAL and isinstance(spec, BlockIDsLoadStoreSpec):
            slots, positions = spec.block_ids, part.positions
        else:
            continue
        for position, slot in zip(positions, slots.tolist(), strict=True):
            out[position] = (sub, slot)
    return out


def subpart(part: Part, picked: list[int]) -> Part:
    """The blocks of a remote store part at these indices of it."""
    spec = part.spec
    assert isinstance(spec, RemoteLoadStoreSpec)
    hashes = [part.block_hashes[i] for i in picked]
    return Part(
        part.tier,
        [part.positions[i] for i in picked],
        hashes,
        RemoteLoadStoreSpec([spec.block_hashes[i] for i in picked], spec.salt),
    )


def own(part: Part, **state: Any) -> Part:
    """`part` with a spec of this worker's own carrying `state` (a load's guard, a store's
    staged copy). The spec it came with may be shared: several workers of one process
    (tensor-parallel tests) are handed the same object, where each worker process of an
    engine gets its own, so state set on it would be another worker's."""
    spec = copy.copy(part.spec)
    for name, value in state.items():
        setattr(spec, name, value)
    return dataclasses.replace(part, spec=spec)


def timed_blocks(part: Part) -> int:
    """The blocks a load part's time is the transfer of: a cascade load that reads the
    disk is timed as the disk's (`medium_of`), and its CPU blocks cost next to nothing
    beside a file read, so the disk's estimate is per block read from disk; 0: nothing
    to time."""
    spec = part.spec
    if isinstance(spec, CascadeLoadSpec) and spec.disk_positions:
        return len(spec.disk_positions)
    # a Redis load's blocks that its lookup read whole (`prefetch`) cost no transfer
    return len(part.block_hashes) - getattr(spec, "prefetched", 0)


def writes_disk(part: Part) -> bool:
    """Whether a store part writes the disk, a demotion included (and so may take the
    writer's queue)."""
    spec = part.spec
    return isinstance(spec, CascadeStoreSpec) and (
        spec.disk is not None or spec.demotion is not None
    )


def writes_disk_in_job(part: Part, device_apart: bool) -> bool:
    """Whether a store part would write the disk in its copy job rather than on the
    writer thread (`split_disk_part`: on a GPU, the blocks a CPU tier too full to take
    them sends straight to disk; a disk part that cannot be cut by block).

    Why it matters after a reset: a disk write of before it may still be in progress
    (a disk that hangs). Writes on the writer thread run after it, and it deletes what
    it wrote once it ends (`CascadeHandler.write`), but one in a copy job could run
    beside it, and a block of the new epoch (the same hash, other bytes after a weight
    update) be overwritten by it. So until it ends (`_fenced`) such parts are shed."""
    spec = part.spec
    if not isinstance(spec, CascadeStoreSpec) or spec.disk is None or not spec.disk_positions:
        return False  # (a demotion alone is always written apart)
    split = split_disk_part(spec, device_apart)
    if split is None:
        return True
    return split.copy is not None and (
        split.copy.disk is not None or split.copy.demotion is not None
    )


def queued_blocks(part: Part) -> int:
    """The blocks a store part holds in its tier's queue: its own, and those of a
    demotion it writes (copied out of their CPU slots into host rows when it is written
    apart: the queue's bound is the bound on that memory too)."""
    demotion = getattr(part.spec, "demotion", None)
    return len(part.positions) + (0 if demotion is None else len(demotion.block_hashes))


def detach_demotion(part: Part) -> Part:
    """A load part whose promotion demotes (`disk_writes: demote`, a full CPU tier),
    with that demotion's write to be cut away from it (`CascadeHandler.detach_write`)."""
    spec = part.spec
    if not isinstance(spec, CascadeLoadSpec) or spec.demotion is None:
        return part
    return own(part, demotion_write=DiskWrite(spec.demotion.dst, demotion=spec.demotion))


def writes_after(spec: object) -> list[DiskWrite]:
    """The disk writes cut away from a store's copy (the worker's `_split_writes`) that wait
    for it."""
    if not isinstance(spec, CopyThenWrite):
        return []
    return [w for w in (spec.then, spec.demotion_write) if w is not None]


def medium_of(part: Part) -> str:
    """The tier a part's transfer is timed under: a cascade job that touches the disk
    (a read, a write-through, a demotion) is the disk's, its time being the disk's."""
    spec = part.spec
    if part.tier == REMOTE:
        return "redis"
    if isinstance(spec, CascadeLoadSpec):
        return "disk" if spec.disk_positions or spec.demotion is not None else "cpu"
    if isinstance(spec, CascadeStoreSpec):
        return "disk" if spec.disk is not None or spec.demotion is not None else "cpu"
    if isinstance(spec, DiskWrite):
        return "disk"
    return "cpu"
