"""The per-request step every replay mode drives: lookup, load, touch, store, tally.

What it counts, and why, is docs/semantics.md section 6.

A request goes through four moments, in this order, whatever the mode:

1. `admit`: the tiers are asked for the prefix (the accelerator first when there
   is one, through the connector, as an engine's scheduler would); the hit blocks
   are pinned and their bytes loaded; all of the request's blocks are touched.
   Hits at any position are the blocks served plus those a local tier held beyond
   the prefix: a block whose load failed is no hit at all, and the blocks of a
   failed load are forgotten by the disk tier (it cannot vouch for them). None: no
   room in the accelerator now.
2. `loaded`: the load's completion reaches the tiers (a failed one as a failure).
3. `computed`: the prefill computed the blocks no tier served; they are offered to
   the tiers, and the stores run and complete.
4. `finished`: the request frees its accelerator blocks.

The clock (`kvtier.sim.clock`) decides when each moment happens: all at once, or
at virtual times (loads in flight for the length of the prefill, accelerator blocks
held until the decode ends). The bytes plane (`kvtier.sim.bytes_plane`) decides
whether bytes move and whether a transfer failed. Both fronts below share the
tallying and the settling of transfers, so every combination counts alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, filterfalse
from operator import not_
from typing import Protocol

from kvtier.connector.chain import ChainSpec, TierChain, settle_load
from kvtier.connector.scheduler import Admission, OffloadConnector, TransferJob
from kvtier.offload.abstract import LoadStoreSpec
from kvtier.request import Request
from kvtier.sim.bytes_plane import BytesPlane, NoBytes, parts_of, position_tiers
from kvtier.sim.ledger import Ledger
from kvtier.sim.metrics import served_tokens
from kvtier.sim.stack import LOCAL, TierStack
from kvtier.sim.store_queues import StoreQueues
from kvtier.sim.workload import Workload
from kvtier.types import BlockHash

# Blocks promoted into the local tier with their local store spec.
Promotion = tuple[list[BlockHash], LoadStoreSpec]


@dataclass(slots=True)
class Pending:
    """One admitted request between its moments."""

    index: int
    hashes: list[BlockHash]
    served: int  # leading blocks the tiers delivered (accelerator hit included)
    load: tuple[list[BlockHash], LoadStoreSpec] | None = None
    load_ok: bool = True
    uncached_tokens: int = 0
    loaded_blocks: int = 0
    request: Request | None = None
    admission: Admission | None = None
    promotions: list[Promotion] | None = None  # planned at the load (OffloadStep)


class Step(Protocol):
    # Whether admitted requests hold blocks until `finished` (an accelerator pool).
    holds_blocks: bool

    def indexes(self) -> Sequence[int]: ...

    def admit(self, index: int) -> Pending | None: ...

    def loaded(self, p: Pending) -> None: ...

    def computed(self, p: Pending) -> None: ...

    def finished(self, p: Pending) -> None: ...


class _Settling:
    """What both fronts do with the tiers' answers: events, stores, lost blocks."""

    def __init__(self, stack: TierStack, plane: BytesPlane, ledger: Ledger) -> None:
        self.stack, self.plane, self.ledger = stack, plane, ledger
        self._lost: set[BlockHash] = set()
        # the members' store queues, with a clock (`kvtier.sim.store_queues`); None: a
        # store is never shed
        self.queues: StoreQueues | None = None
        self._local_label = "disk" if stack.cascade is not None else "cpu"
        # Without bytes every transfer succeeds and nothing is lost: the calls that
        # would say so are skipped (and the engine's blocks need no ids nor contents).
        self.moves_bytes = not isinstance(plane, NoBytes)

    def drain(self) -> None:
        self.ledger.events(self.stack.take_events())

    def store(self, spec: LoadStoreSpec, ids: Sequence[int], stored: list[BlockHash]) -> bool:
        """Run the store; settle a chain's parts one by one. True if every part succeeded.
        A part its member's queue sheds completes as a store that did not happen."""
        chain = self.stack.chain
        if chain is None and not self.moves_bytes and self.queues is None:
            return True
        parts = parts_of(spec, stored)
        oks = [self._admit(name, part, sub) for name, part, sub in parts]
        if self.moves_bytes and any(oks):  # the bytes of the parts not shed
            kept = spec
            if not all(oks):  # (a chain's: only a chain has several parts)
                kept = ChainSpec([p for p, ok in zip(parts, oks, strict=True) if ok])
            moved = iter(self.plane.store(kept, ids, stored))
            oks = [ok and next(moved)[1] for ok in oks]
        if chain is not None:
            for (name, part, _), ok in zip(parts, oks, strict=True):
                chain.complete_part(name, part, ok)
        return all(oks)

    def _admit(self, member: str, part: list[BlockHash], spec: LoadStoreSpec) -> bool:
        """Whether the member's queue takes the part. A local part's demotion (the blocks
        it evicts from a full CPU tier, written to disk) counts in the queue too, as in
        an engine, and is lost with a shed part: the cascade forgets its blocks."""
        demotion = getattr(spec, "demotion", None) if member == LOCAL else None
        demoted = [] if demotion is None else list(demotion.block_hashes)
        if self.queues is None or self.queues.admit(member, len(part) + len(demoted)):
            return True
        tier = self._local_label if member == LOCAL else "remote"
        self.ledger.tiers[tier].shed_blocks += len(part)
        if demoted:
            self.ledger.store_failed("disk", len(demoted))
            self._lost.update(demoted)
        return False

    def locate(
        self, hashes: list[BlockHash], in_gpu: list[bool] | None = None
    ) -> tuple[int, list[BlockHash]]:
        """Where the blocks are now: how many are held in memory (accelerator, CPU), and
        which are only on disk; the rest are nowhere the replay can vouch for (the
        shared tier counts only when it serves). Set operations at C speed: this runs
        for every block of every request."""
        resident = self.ledger.resident
        rest = hashes
        if in_gpu is not None and True in in_gpu:
            rest = list(compress(hashes, map(not_, in_gpu)))
        for name, r in resident.items():
            if r and name not in ("disk", "remote"):
                rest = list(filterfalse(r.__contains__, rest))
        disk = resident.get("disk")
        return len(hashes) - len(rest), list(filter(disk.__contains__, rest)) if disk else []

    def held_beyond(self, held: int, on_disk: list[BlockHash]) -> int:
        """Blocks past the prefix that a local tier holds and could serve (`locate`'s
        answer): those only on disk are read and checked first (with real bytes), so a
        corrupt file is no hit."""
        if not on_disk:
            return held
        return held + len(on_disk) - len(self.plane.unreadable(on_disk))

    def promote(self, spec: LoadStoreSpec, loaded: list[BlockHash], ids: Sequence[int]) -> None:
        """Copy blocks a lower tier served up into the local tier, bytes included (the
        chain's own promotion would move none)."""
        self.settle_promotions(self.plan_promotions(spec, loaded), loaded, ids, ok=True)

    def plan_promotions(self, spec: LoadStoreSpec, loaded: list[BlockHash]) -> list[Promotion]:
        """Local slots for the blocks a lower tier serves, taken as the load is prepared
        (as kvtier's vLLM adapter takes them: the promoted blocks are then part of the
        request's use); settle them with the load."""
        chain = self.stack.chain
        if chain is None:
            return []
        lower = [h for name, part, _ in parts_of(spec, loaded) if name != LOCAL for h in part]
        if not lower:
            return []
        out = chain.plan_promotion(0, lower)  # one store, as the request's one load
        self.drain()
        if out is None or not out.block_hashes_to_store:
            return []
        return [(out.block_hashes_to_store, out.store_spec)]

    def settle_promotions(
        self, planned: list[Promotion], loaded: list[BlockHash], ids: Sequence[int], ok: bool
    ) -> None:
        """Write the promoted blocks if the load brought them (regenerated from their
        hashes, which the load just verified, so the source is right even if the engine
        cache was reused since), and settle their stores."""
        chain = self.stack.chain
        if chain is None:
            return
        position = dict(zip(loaded, ids, strict=True))
        for stored, spec in planned:
            written = False
            if ok:
                stored_ids = [position[h] for h in stored]
                self.plane.compute(stored_ids, stored)
                (_, written), *_ = self.plane.store(spec, stored_ids, stored)
            chain.settle_promotion(0, stored, written)
            self.drain()

    def distrust(self, spec: LoadStoreSpec, loaded: list[BlockHash]) -> None:
        """A load failed: its disk blocks are forgotten once unpinned (the disk store
        drops the first bad file it meets; the others of the job may be bad too)."""
        tiers = position_tiers(spec, len(loaded))
        self._lost.update(h for h, tier in zip(loaded, tiers, strict=True) if tier == "disk")

    def forget_lost(self) -> None:
        """Disk blocks the bytes plane lost, or a shed store's demotion, leave the cascade
        (dropped, not evicted). Blocks still pinned by a job in flight are forgotten
        once it completes."""
        if self.moves_bytes:
            self._lost.update(self.plane.take_lost())
        cascade = self.stack.cascade
        if not self._lost or cascade is None:
            return
        self.drain()
        removed = cascade.discard_disk_blocks(list(self._lost))
        self.ledger.events(self.stack.take_events(), faults=True)
        on_disk = self.ledger.resident["disk"]
        self._lost = {h for h in self._lost if h in on_disk and h not in removed}


class OffloadStep(_Settling):
    """No accelerator tier: the replay talks to the offload tiers directly.

    The engine cache of the bytes plane is a scratch area as large as the longest
    request: block `i` of the request being replayed sits in device block `i`.
    """

    holds_blocks = False

    def __init__(
        self, workload: Workload, stack: TierStack, plane: BytesPlane, ledger: Ledger
    ) -> None:
        super().__init__(stack, plane, ledger)
        self.workload = workload
        self.refused = 0

    def indexes(self) -> Sequence[int]:
        return range(len(self.workload.requests))

    def admit(self, index: int) -> Pending:
        w, ledger, manager = self.workload, self.ledger, self.stack.manager
        hs = w.block_hashes[index]
        hit = manager.lookup(hs) or 0  # None ("ask again") is a miss for a replay
        beyond = hs[hit:]
        ledger.any_hits += self.held_beyond(*self.locate(beyond))
        p = Pending(index, hs, 0, loaded_blocks=hit)
        if hit:
            loaded = hs[:hit]
            spec = manager.prepare_load(loaded)
            p.load = (loaded, spec)
            p.promotions = self.plan_promotions(spec, loaded)
            p.load_ok = self.plane.load(spec, range(hit), loaded)
            if p.load_ok:  # a failed or corrupt load is a miss: recompute
                p.served = hit
                ledger.served(index, position_tiers(spec, hit))
            else:
                self.distrust(spec, loaded)
        ledger.any_hits += p.served
        input_length = w.requests[index].input_length
        ledger.prefill_tokens_saved += served_tokens(p.served, w.block_size, input_length)[1]
        p.uncached_tokens = max(0, input_length - hit * w.block_size)
        manager.touch(hs)
        self.drain()
        return p

    def loaded(self, p: Pending) -> None:
        if p.load is not None:
            loaded, _ = p.load
            settle_load(self.stack.manager, loaded, p.load_ok)
            self.drain()
            self.settle_promotions(p.promotions or [], loaded, range(len(loaded)), p.load_ok)
            self.forget_lost()

    def computed(self, p: Pending) -> None:
        hs, first = p.hashes, p.served
        if first >= len(hs):
            return
        rest = hs[first:]
        self.plane.compute(range(first, len(hs)), rest)
        absent = self.ledger.absent(rest)
        out = self.stack.manager.prepare_store(rest)
        self.drain()
        if out is None:
            self.refused += 1
            return
        stored = out.block_hashes_to_store
        self.ledger.filtered("cpu", len(absent) - sum(map(set(stored).__contains__, absent)))
        position = {h: i for i, h in enumerate(hs)}
        ok = self.store(out.store_spec, [position[h] for h in stored], stored)
        if not isinstance(self.stack.manager, TierChain):
            self.stack.manager.complete_store(stored, success=ok)
        self.drain()
        self.forget_lost()

    def finished(self, p: Pending) -> None:
        pass


class ConnectorStep(_Settling):
    """An accelerator tier in front: requests go through the connector.

    Each request is built from its trace hashes (only full blocks have one, as in the
    engine); hit rates keep the trace's denominator (all block references, partial
    last blocks included) so they compare with the offload-only replay and the bounds.

    The tiers' events are drained into the ledger once at the end of each moment
    that may cause some (admission, a load's completion, the prefill's stores), so it
    is current wherever it is read, not after every call: the same figures.
    """

    holds_blocks = True

    def __init__(
        self,
        workload: Workload,
        connector: OffloadConnector,
        stack: TierStack,
        plane: BytesPlane,
        ledger: Ledger,
    ) -> None:
        super().__init__(stack, plane, ledger)
        self.workload, self.connector = workload, connector
        bs = workload.block_size
        self._requests: dict[int, Request] = {}
        for i, (r, hs) in enumerate(zip(workload.requests, workload.block_hashes, strict=True)):
            if r.input_length:
                full = r.input_length // bs  # (the request copies its hashes)
                self._requests[i] = Request.from_block_hashes(
                    f"r{i}", hs if full >= len(hs) else hs[:full], r.input_length, block_size=bs
                )

    def indexes(self) -> Sequence[int]:
        return list(self._requests)

    def _hashes(self, request: Request) -> list[BlockHash]:
        c = self.connector
        return list(request.get_block_hashes(c.block_size, c.gpu.hash_algorithm))

    def admit(self, index: int) -> Pending | None:
        c, ledger, bs = self.connector, self.ledger, self.workload.block_size
        request, hs = self._requests[index], self.workload.block_hashes[index]
        in_gpu = c.gpu.are_cached(hs)  # before admission moves any
        adm = c.admit(request)
        if adm is None:
            self.drain()
            return None
        gpu_hit, ext = adm.gpu_hit_blocks, adm.offload_hit_blocks
        # What the tiers held before this admission (its events are drained later).
        where = self.locate(hs[gpu_hit + ext :], in_gpu[gpu_hit + ext :])
        hashes = ids = None
        if self.moves_bytes:
            hashes = self._hashes(request)
            ids = c.gpu.get_block_ids(request.request_id)
            if not self.plane.verify(ids[:gpu_hit], hashes[:gpu_hit]):
                ledger.checksum_failed("gpu")
        if gpu_hit:
            ledger.served_from(index, "gpu", gpu_hit)
        p = Pending(index, hs, gpu_hit, request=request, admission=adm, loaded_blocks=ext)
        if adm.load is not None:
            job = adm.load
            p.load = (job.block_hashes, job.spec)
            p.load_ok = self.plane.load(job.spec, job.gpu_block_ids, job.block_hashes)
            if p.load_ok:
                p.served += ext
                ledger.served(index, position_tiers(job.spec, ext), start=gpu_hit)
            else:
                self.distrust(job.spec, job.block_hashes)
        # At any position: what was served, and what sat in a tier beyond the prefix.
        ledger.any_hits += p.served + self.held_beyond(*where)
        ledger.prefill_tokens_saved += p.served * bs  # the connector kept the last token
        full = request.num_prompt_tokens // bs
        ledger.tiers["gpu"].stores += full - gpu_hit
        if ids is not None and hashes is not None:
            self.plane.compute(ids[p.served : full], hashes[p.served : full])
        p.uncached_tokens = request.num_tokens - (gpu_hit + ext) * bs
        for store in adm.stores:
            self._store_job(store)
        self.drain()
        return p

    def loaded(self, p: Pending) -> None:
        adm = p.admission
        if adm is not None and adm.load is not None:
            job = adm.load
            self.connector.finish_load(job, p.load_ok)
            if p.load_ok:
                self.promote(job.spec, job.block_hashes, job.gpu_block_ids)
            self.forget_lost()
            self.drain()

    def computed(self, p: Pending) -> None:
        c, adm, request = self.connector, p.admission, p.request
        if adm is None or request is None:
            return
        absent: list[BlockHash] = []  # the blocks in no tier, offered to the tiers now
        if c.store_on == "compute":
            first = adm.gpu_hit_blocks + adm.offload_hit_blocks
            absent = self.ledger.absent(
                request.get_block_hashes(c.block_size, c.gpu.hash_algorithm)[first:]
            )
        counters = c.counters  # (updated in place)
        refusals = counters.store_rejections
        job = c.computed(request)
        if absent and counters.store_rejections == refusals:
            stored = job.block_hashes if job is not None else []
            if stored != absent:  # usually equal: every absent block was stored
                taken = set(stored)
                self.ledger.filtered("cpu", len(absent) - sum(map(taken.__contains__, absent)))
        self._store_job(job)
        self.drain()

    def _store_job(self, job: TransferJob | None) -> None:
        if job is None:
            return
        ok = self.store(job.spec, job.gpu_block_ids, job.block_hashes)
        self.connector.finish_store(job, ok)
        self.forget_lost()

    def finished(self, p: Pending) -> None:
        if p.request is not None:
            self.connector.finish(p.request)  # frees accelerator blocks only: no events
