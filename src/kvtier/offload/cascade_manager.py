"""The local cascade: CPU memory first, local disk second, as one `OffloadingManager`.

Decisions, and why:

- Lookup counts the leading hashes ready in either tier (in practice CPU hits, then
  disk hits); a prefix is only useful up to its first miss, so there are no holes.
- A block the cascade holds anywhere is not stored again (`block_hashes_to_store`
  lists only hashes absent from both tiers). When the CPU cannot take a store
  (its blocks pinned or in flight), the part that does not fit in its free slots
  goes straight to disk instead of being refused.
- Disk writes happen on CPU eviction by default ("demote": an SSD's lifetime is
  spent only on blocks that outlived the CPU tier), or on every CPU store
  ("write_through", by option). The disk tier may be wrapped in
  `FilterReusedOffloadingManager` as admission: it counts the lookups that reach
  the disk, or the demotion offers with `count_store_offers=True`.
- A demoted block never becomes unreadable: its disk copy is registered ready at
  once and pinned until the job carrying the demotion completes. Until then its
  bytes are in the CPU slot the evicting store is about to overwrite, so the load
  spec names that slot (`demoting`) and the data plane reads whichever copy exists.
  This relies on the cascade's data plane running jobs in submission order (one
  queue; `kvtier.transfer.cascade_handler`), so a demotion always precedes the overwrite,
  and on the engine submitting each job before it prepares a later store (the
  normal step order): a load prepared while a demotion is pending must not queue
  behind a store of a later step that reuses the same slot. (A data plane that
  writes a store's demotion apart from its copy, from host rows taken before the
  overwrite, fails such a load in the window between the two: a recompute.)
- Disk hits are promoted into CPU slots as part of the load (`promote`, default on);
  the disk copy stays, so evicting the block from CPU again costs no write.

Data plane contract: a store job gets a `CascadeStoreSpec`, a load job a
`CascadeLoadSpec`; the scheduler answers with `complete_store(block_hashes_to_store,
success)` or `complete_load(block_hashes, success)`, which also settle everything
the job carried (write-through copies, promotions, demotion pins). A data plane that
writes a store's disk part apart from its CPU copy may say the copy is done first
(`complete_copy`): the CPU copies are readable from then on. A demotion that
fails on disk surfaces as a failed load later (a miss), and
`discard_disk_blocks` forgets it. `block_hashes_evicted` lists the hashes that left
the cascade (not those merely demoted). Events come from each tier with its own
medium ("CPU", "DISK"), in the order they happened.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.offload.abstract import (
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    RecordedEvents,
    block_hash_list,
    reset_tier,
    unique_hashes,
)
from kvtier.offload.mediums import BlockIDsLoadStoreSpec, CPULoadStoreSpec
from kvtier.types import BlockHash

CPU, DISK = "CPU", "DISK"


@dataclass(frozen=True)
class Demotion:
    """Copy CPU slots `src` (still holding evicted blocks) to disk `dst`, before reuse."""

    block_hashes: list[BlockHash]
    src: CPULoadStoreSpec
    dst: LoadStoreSpec


@dataclass
class CascadeStoreSpec(LoadStoreSpec):
    """Run `demotion`, then device blocks at `cpu_positions` -> CPU slots `cpu`, and at
    `disk_positions` -> disk `disk` (from the CPU slots when also stored there)."""

    cpu: BlockIDsLoadStoreSpec | None = None
    cpu_positions: list[int] = field(default_factory=list)
    disk: LoadStoreSpec | None = None
    disk_positions: list[int] = field(default_factory=list)
    demotion: Demotion | None = None

    @staticmethod
    def medium() -> str:
        return "CASCADE"


@dataclass
class CascadeLoadSpec(LoadStoreSpec):
    """Run `demotion`; blocks at `cpu_positions` come from CPU slots, at `disk_positions`
    from disk (or, for positions in `demoting`, from that CPU slot if not yet on disk);
    then those at `promotion_positions` are copied into the CPU slots `promotion`."""

    cpu: BlockIDsLoadStoreSpec | None = None
    cpu_positions: list[int] = field(default_factory=list)
    disk: LoadStoreSpec | None = None
    disk_positions: list[int] = field(default_factory=list)
    demoting: dict[int, int] = field(default_factory=dict)
    promotion: BlockIDsLoadStoreSpec | None = None
    promotion_positions: list[int] = field(default_factory=list)
    demotion: Demotion | None = None
    # a `kv_store.LoadGuard` the worker sets on its own copy where the load has a
    # deadline (a stalled disk): once given up, nothing of it reaches the engine
    guard: Any = None
    # the worker's, on its own copy: `demotion` written apart from the load (a
    # `cascade_handler.DiskWrite`), so the request does not wait for the disk
    demotion_write: Any = None

    @staticmethod
    def medium() -> str:
        return "CASCADE"


@dataclass
class _Group:
    """Demoted blocks pinned on disk until every store of the job carrying them completes."""

    pinned: list[BlockHash] = field(default_factory=list)
    waiting: set[BlockHash] = field(default_factory=set)


def block_status_core(manager: OffloadingManager) -> Any:
    """The manager holding block status, under any admission filters: the cascade and the
    engine adapter read residency there, where the filters do not answer."""
    while not hasattr(manager, "get_block"):
        inner = getattr(manager, "backing", None)
        if inner is None:
            raise TypeError(f"{type(manager).__name__} exposes no get_block() for the cascade")
        manager = inner
    return manager


class CascadeOffloadingManager(RecordedEvents, OffloadingManager):
    """CPU tier first, disk tier second; see the module docstring."""

    def __init__(
        self,
        cpu: OffloadingManager,
        disk: OffloadingManager,
        *,
        disk_writes: Literal["demote", "write_through"] = "demote",
        promote: bool = True,
        enable_events: bool = False,
    ) -> None:
        if disk_writes not in ("demote", "write_through"):
            raise ValueError(
                f"disk_writes must be 'demote' or 'write_through', got {disk_writes!r}"
            )
        self.cpu, self.disk = cpu, disk
        self._cpu_core, self._disk_core = block_status_core(cpu), block_status_core(disk)
        self.write_through = disk_writes == "write_through"
        self.promote = promote
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._cpu_slots: dict[BlockHash, int] = {}  # CPU slot of every block in CPU
        self._groups: dict[BlockHash, _Group] = {}  # store in flight -> demotions riding on it
        self._disk_stores: set[BlockHash] = set()  # in flight to disk, completing with itself
        self._demoting: dict[BlockHash, int] = {}  # demoted, job pending -> its old CPU slot
        self._pins: defaultdict[BlockHash, deque[str]] = defaultdict(deque)
        self._promoting: set[BlockHash] = set()
        self._copied: set[BlockHash] = set()  # CPU copy done, store in flight (complete_copy)

    def on_disk(self, block_hash: BlockHash) -> bool:
        """Whether the disk tier holds the block (ready, pinned or being stored)."""
        return self._disk_core.get_block(block_hash) is not None

    def _present(self, block_hash: BlockHash) -> bool:
        return self._cpu_core.get_block(block_hash) is not None or self.on_disk(block_hash)

    # --- reading -----------------------------------------------------------

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        hashes = list(block_hashes)
        hits = self.cpu.lookup(hashes)  # each tier counts what reached it (filters, counters)
        if hits is None or hits == len(hashes):
            return hits
        if self.disk.lookup(hashes[hits:]) is None:
            return None
        cpu, disk = self._cpu_core, self._disk_core
        while hits < len(hashes) and (
            block_ready(cpu, hashes[hits]) or block_ready(disk, hashes[hits])
        ):
            hits += 1
        return hits

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        hashes = block_hash_list("prepare_load", block_hashes)  # a load per listing
        spec = CascadeLoadSpec()
        for i, block_hash in enumerate(hashes):
            if block_ready(self._cpu_core, block_hash):
                spec.cpu_positions.append(i)
            elif block_ready(self._disk_core, block_hash):
                spec.disk_positions.append(i)
                if block_hash in self._demoting:
                    spec.demoting[i] = self._demoting[block_hash]
            else:
                raise KeyError(f"prepare_load: block {block_hash!r} is not ready in any tier")
        cpu_hashes = [hashes[i] for i in spec.cpu_positions]
        disk_hashes = [hashes[i] for i in spec.disk_positions]
        if cpu_hashes:
            spec.cpu = self.cpu.prepare_load(cpu_hashes)  # type: ignore[assignment]
        if disk_hashes:
            spec.disk = self.disk.prepare_load(disk_hashes)
        for block_hash in cpu_hashes:
            self._pins[block_hash].append(CPU)
        for block_hash in disk_hashes:
            self._pins[block_hash].append(DISK)
        if self.promote and disk_hashes:
            self._plan_promotion(hashes, disk_hashes, spec)
        self._drain()
        return spec

    def _plan_promotion(
        self, hashes: list[BlockHash], disk_hashes: list[BlockHash], spec: CascadeLoadSpec
    ) -> None:
        absent = [h for h in disk_hashes if self._cpu_core.get_block(h) is None]
        planned = self._store_in_cpu(absent, protect=[])
        if planned is None:
            return  # CPU full of pinned blocks: serve from disk without promoting
        output, group, demotion, _ = planned
        spec.demotion = demotion
        if output.block_hashes_to_store:
            position = {h: i for i, h in enumerate(hashes)}
            spec.promotion = output.store_spec  # type: ignore[assignment]
            spec.promotion_positions = [position[h] for h in output.block_hashes_to_store]
            self._promoting.update(output.block_hashes_to_store)
        self._attach(output.block_hashes_to_store, group)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        hashes = list(block_hashes)
        self.cpu.touch(hashes)
        self.disk.touch(hashes)

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Unpin; and settle the promotion planned by `prepare_load` (`success` of the job)."""
        hashes = block_hash_list("complete_load", block_hashes)
        listed = Counter(hashes)  # a hash listed k times releases k loads
        for block_hash, n in listed.items():
            if len(self._pins.get(block_hash, ())) < n:
                raise KeyError(
                    f"complete_load: block {block_hash!r} is not being loaded {n} time(s)"
                )
        tiers = [self._pins[block_hash].popleft() for block_hash in hashes]
        for block_hash in listed:
            if not self._pins[block_hash]:
                del self._pins[block_hash]
        self.cpu.complete_load([h for h, t in zip(hashes, tiers, strict=True) if t == CPU])
        self.disk.complete_load([h for h, t in zip(hashes, tiers, strict=True) if t == DISK])
        promoted = [h for h in listed if h in self._promoting]
        self._promoting.difference_update(promoted)
        self.complete_store(promoted, success)

    # --- writing -----------------------------------------------------------

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        hashes = unique_hashes(block_hash_list("prepare_store", block_hashes))
        on_disk = [h for h in hashes if self._cpu_core.get_block(h) is None and self._present(h)]
        skip = set(on_disk)
        cpu_input = [h for h in hashes if h not in skip]
        planned = self._store_in_cpu(cpu_input, protect=on_disk)
        if planned is None:
            return self._store_split(cpu_input, on_disk)
        output, group, demotion, lost = planned
        stored = output.block_hashes_to_store
        spec = CascadeStoreSpec(output.store_spec, list(range(len(stored))), demotion=demotion)  # type: ignore[arg-type]
        if self.write_through and stored:
            through = self.disk.prepare_store(stored + on_disk)
            if through is not None:
                self._disk_part(spec, stored, through)
                lost += self._left(through.block_hashes_evicted)
        self._attach(stored, group)
        self._drain()
        return PrepareStoreOutput(stored, spec, lost)

    def _store_split(
        self, cpu_input: list[BlockHash], on_disk: list[BlockHash]
    ) -> PrepareStoreOutput | None:
        """The CPU cannot evict enough: fill its free slots, send the rest to disk."""
        absent = [h for h in cpu_input if self._cpu_core.get_block(h) is None]
        free = self._cpu_core.backend.get_num_free_blocks()
        to_cpu, to_disk = absent[:free], absent[free:]
        to_disk_too = absent if self.write_through else to_disk
        through = self.disk.prepare_store(to_disk_too + on_disk)
        if through is None:
            self._drain()
            return None
        sent = set(to_disk)
        output = self.cpu.prepare_store([h for h in cpu_input if h not in sent])
        if output is None:  # cannot happen (only free slots are used); keep the contract
            self.disk.complete_store(through.block_hashes_to_store, success=False)
            self._drain()
            return None
        self._remember_slots(output)
        # An admission filter may have kept some of `to_disk` out: those are not stored.
        kept = set(through.block_hashes_to_store)
        stored = output.block_hashes_to_store + [h for h in to_disk if h in kept]
        spec = CascadeStoreSpec(output.store_spec, list(range(len(to_cpu))))  # type: ignore[arg-type]
        self._disk_part(spec, stored, through)
        self._drain()
        return PrepareStoreOutput(stored, spec, self._left(through.block_hashes_evicted))

    def _disk_part(
        self,
        spec: CascadeStoreSpec,
        stored: list[BlockHash],
        through: PrepareStoreOutput,
    ) -> None:
        position = {h: i for i, h in enumerate(stored)}
        if through.block_hashes_to_store:
            spec.disk = through.store_spec
            spec.disk_positions = [position[h] for h in through.block_hashes_to_store]
            self._disk_stores.update(through.block_hashes_to_store)

    def _store_in_cpu(
        self, hashes: list[BlockHash], protect: list[BlockHash]
    ) -> tuple[PrepareStoreOutput, _Group, Demotion | None, list[BlockHash]] | None:
        """CPU prepare_store, then the demotion of what it evicted; None if the CPU cannot.

        Also returns the hashes that left the cascade (evicted and not demoted).
        """
        output = self.cpu.prepare_store(hashes)
        if output is None:
            return None
        evicted = output.block_hashes_evicted
        evicted_slots = {h: self._cpu_slots.pop(h) for h in evicted}
        self._remember_slots(output)
        group = _Group()
        if not evicted or self.write_through:
            return output, group, None, self._left(evicted)
        demoted = self.disk.prepare_store(evicted + protect)
        if demoted is None or not demoted.block_hashes_to_store:
            lost = self._left(evicted + (demoted.block_hashes_evicted if demoted else []))
            return output, group, None, lost
        moving = demoted.block_hashes_to_store
        lost = self._left(evicted + demoted.block_hashes_evicted)
        self.disk.complete_store(moving)  # readable at once: see the module docstring
        self.disk.prepare_load(moving)  # pinned until the job that writes them completes
        group.pinned = list(moving)
        for block_hash in moving:
            self._demoting[block_hash] = evicted_slots[block_hash]
        src = CPULoadStoreSpec([evicted_slots[h] for h in moving])
        return output, group, Demotion(list(moving), src, demoted.store_spec), lost

    def _remember_slots(self, output: PrepareStoreOutput) -> None:
        spec = output.store_spec
        if not isinstance(spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"the CPU tier must hand out slot ids, got {spec!r}")
        self._cpu_slots.update(
            zip(output.block_hashes_to_store, spec.block_ids.tolist(), strict=True)
        )

    def _left(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """The hashes present in neither tier any more."""
        return [h for h in hashes if not self._present(h)]

    def _attach(self, stored: list[BlockHash], group: _Group) -> None:
        if group.pinned:
            group.waiting.update(stored)
            for block_hash in stored:
                self._groups[block_hash] = group

    def complete_copy(self, block_hashes: Iterable[BlockHash]) -> None:
        """The CPU copy of these blocks is done while their store's disk writes go on (a
        data plane that writes the disk apart from the copy: the blocks' write-through,
        or the demotion of the blocks they evicted): they are readable from the CPU tier
        now, and pinned there until the store completes (a write-through reads their
        slots). Their disk copies stay in flight. Hashes not being stored to the CPU tier
        (settled already, or a promotion's) are ignored.

        Why: a slow disk would otherwise keep blocks the CPU tier holds unreadable for as
        long as the disk's queue of writes, and a prompt that returns meanwhile would be
        recomputed (a returning prompt missed all its blocks behind 20 ms writes)."""
        core = self._cpu_core
        ready = []
        for block_hash in unique_hashes(block_hash_list("complete_copy", block_hashes)):
            block = core.get_block(block_hash)
            if block is not None and block.ref_cnt < 0 and block_hash not in self._promoting:
                ready.append(block_hash)
        if not ready:
            return
        self.cpu.complete_store(ready)
        for block_hash in ready:  # pinned as a load pins (not counted as one)
            core.get_block(block_hash).ref_cnt += 1
        self._copied.update(ready)
        self._drain()

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Settle a store; blocks whose CPU copy was done already (`complete_copy`) are
        unpinned and stay in the CPU tier if their disk part failed."""
        hashes = unique_hashes(block_hash_list("complete_store", block_hashes))
        copied = [h for h in hashes if h in self._copied] if self._copied else []
        if copied:
            self._copied.difference_update(copied)
            self.cpu.complete_load(copied)
        if not success:
            for block_hash in hashes:
                block = self._cpu_core.get_block(block_hash)
                if block is not None and block.ref_cnt < 0:
                    self._cpu_slots.pop(block_hash, None)
        self.cpu.complete_store(hashes, success)
        own = [h for h in hashes if h in self._disk_stores]
        if own:
            self._disk_stores.difference_update(own)
            self.disk.complete_store(own, success)
        for block_hash in hashes:
            group = self._groups.pop(block_hash, None)
            if group is None:
                continue
            group.waiting.discard(block_hash)
            if not group.waiting:  # the job is over: its demotions are on disk or lost
                for pinned in group.pinned:
                    self._demoting.pop(pinned, None)
                self.disk.complete_load(group.pinned)
        self._drain()

    # --- events and maintenance --------------------------------------------

    def _drain(self) -> None:
        for tier in (self.cpu, self.disk):
            events = tier.take_events()
            if self.events is not None:
                self.events.extend(events)

    def reset_cache(self) -> list[BlockHash]:
        """Forget every block of both tiers (see `PolicyOffloadingManager.reset_cache`):
        CPU slots freed, disk blocks forgotten (their files go with the disk backend's
        `on_free`), demotions and promotions in flight dropped with their jobs. Returns
        the keys forgotten; each tier's removal event is among the cascade's events."""
        removed = reset_tier(self.cpu) + reset_tier(self.disk)
        self._cpu_slots.clear()
        self._groups.clear()
        self._disk_stores.clear()
        self._demoting.clear()
        self._pins.clear()
        self._promoting.clear()
        self._copied.clear()
        self._drain()
        return removed

    def held_keys(self) -> list[BlockHash]:
        """Every key either tier holds (in flight included), each once."""
        disk = self._disk_core.policy.stored_keys()
        return list(dict.fromkeys([*self._cpu_slots, *disk]))

    def discard_disk_blocks(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """Forget disk blocks the data plane lost or found corrupt (a disk tier with `discard`)."""
        removed: list[BlockHash] = self._disk_core.discard(list(block_hashes))
        self._drain()
        return removed


def block_ready(core: Any, block_hash: BlockHash) -> bool:
    """Whether a tier's block status (None: no such tier) says the block is there to
    load: present and not being stored. Uncounted: the tiers' lookup counters are
    vLLM's questions."""
    block = None if core is None else core.get_block(block_hash)
    return block is not None and block.ref_cnt >= 0
