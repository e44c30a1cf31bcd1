"""vLLM's scheduler-side `OffloadingManager` (0.32/0.33) over kvtier's own managers.

An adapter, not a second implementation: every decision (which block to keep,
evict, demote to disk or promote back) is made by the managers that the replay tool
and kvtier's vLLM 0.19 interface use, so a replay predicts what an engine does.

- `local` is kvtier's CPU manager (with its policy and `store_threshold` filter), or
  the CPU -> disk cascade when a disk tier is configured.
- `remote` is the shared Redis tier's manager with asynchronous lookups: a key whose
  answer is not in yet is RETRY, so the scheduler asks again on a later step
  instead of waiting on the network.

vLLM asks about one key at a time, walking a request's chunks in order; a chunk held
locally is a hit there first. Stores are offered to both tiers (write-through to the
shared tier, as kvtier's `TierChain` does), and one store job carries each tier's
part. Blocks a load takes from Redis are promoted into the local tier: the load job
writes them from the device into local slots once they are in, and the promotion
completes with the load (a failed load promotes nothing).

What the worker reports as failed (a part of a job, a disk block found corrupt,
a demotion that did not reach the disk) comes back through `KvtierConnector` and is
applied by `apply_worker_report` before vLLM completes the job, so a failed store is
never made readable and a corrupt block is forgotten.

Keys: vLLM's `OffloadKey` is a block hash followed by a 4-byte KV-group index. An
engine of one KV-cache group gives kvtier's managers the bare block hash
(byte-identical to kvtier's own `sha256_cbor` hashes) and events get the suffix back;
an engine of several (a hybrid model: full and sliding-window attention) keeps the
whole key (`whole_keys`), so each group's copy of a block is a block of its own in
every tier. vLLM decides which keys of each group to look up, store and load (of a
sliding-window group, only those in the window at the hit point).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Collection, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import cast

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from kvtier.connector.chain import ChainSpec, TierChain
from kvtier.connector.cost_model import CostModel
from kvtier.offload.abstract import OffloadingManager as KvtierManager
from kvtier.offload.abstract import reset_tier
from kvtier.offload.cascade_manager import (
    CascadeLoadSpec,
    CascadeOffloadingManager,
    block_status_core,
)
from kvtier.remote.remote_manager import epoch_salt
from kvtier.types import BlockHash
from kvtier.vllm.offloading.disk_runs import DiskRuns
from kvtier.vllm.offloading.job_specs import (
    LOCAL,
    REMOTE,
    KvtierLoadSpec,
    KvtierStoreSpec,
    Part,
    WorkerReport,
)
from kvtier.vllm.offloading.prompt_keys import PromptChain, Prompts, request_state
from kvtier.vllm.offloading.remote_runs import RemoteRuns, plan_of
from kvtier.vllm.offloading.tier_stats import TierStats

log = logging.getLogger(__name__)

GROUP_SUFFIX = (0).to_bytes(4, "big")
# Where recent lookups found each block, so `prepare_load` does not look again (a
# lookup is not free of effects: the reuse filter counts it). Bounded: vLLM looks up
# chunks it may never load.
MAX_REMEMBERED_HITS = 1 << 16
# A Redis hit answers later lookups of the same block until a load takes it (or it
# ages out of this bounded memory). vLLM asks key by key and step by step until every
# key of a prefix has its answer, and an asynchronous answer is read once: forgetting
# answers (after a time, as first written) made a loaded machine re-ask a 128-block
# prefix for minutes. A block Redis evicted since fails its load: a recompute.
# kvtier medium -> (vLLM medium, locality) for vLLM's KV events.
_MEDIA: dict[str, tuple[Medium, Locality]] = {
    "CPU": (Medium.CPU, Locality.LOCAL),
    "DISK": (Medium.STORAGE, Locality.LOCAL),
    "REMOTE": (Medium.STORAGE, Locality.REMOTE),
}


_HIT, _MISS = LookupResult.HIT, LookupResult.MISS
_Load = tuple[list[tuple[str, list[BlockHash]]], list[BlockHash], int]


@dataclass
class _RequestUse:
    """Blocks a request loaded and has not yet used. vLLM 0.32's connector never calls
    `touch`, so kvtier's tiers learn recency where a request's blocks pass: its loaded
    blocks and the blocks it offers at its next `prepare_store` are used then, head to
    tail as one use (policies read one touch as one request: LRU keeps its root most
    recent), before the store; a request that stores nothing uses its loaded blocks
    when it finishes. A replay's request touches its blocks before it stores them: the
    same order, so the replay predicts the engine."""

    loaded: list[BlockHash] = field(default_factory=list)
    # blocks whose load for this request failed (a deadline, a corrupt block): vLLM
    # reschedules the request and asks again, and they must then miss, or a tier that
    # keeps failing the load (a hung disk, a stalled Redis) would be offered for ever
    failed: set[BlockHash] = field(default_factory=set)


def _use_of(req_context: ReqContext) -> _RequestUse:
    return request_state(req_context, _RequestUse)


def block_hash_of(key: OffloadKey) -> BlockHash:
    """An engine of one KV-cache group: the key's block hash."""
    if not key.endswith(GROUP_SUFFIX):
        raise ValueError(
            f"offload key {bytes(key).hex()} is of KV-cache group "
            f"{int.from_bytes(key[-4:], 'big')}; this engine was started with one group"
        )
    return BlockHash(bytes(key[:-4]))


def key_of(block_hash: BlockHash) -> OffloadKey:
    return OffloadKey(block_hash + GROUP_SUFFIX)


def whole_key(key: OffloadKey) -> BlockHash:
    """An engine of several KV-cache groups: the whole key names the group's block."""
    return BlockHash(bytes(key))


class KvtierOffloadingManager(OffloadingManager):
    def __init__(
        self,
        local: KvtierManager,
        remote: KvtierManager | None = None,
        *,
        whole_keys: bool = False,
        enable_events: bool = False,
        on_close: Callable[[], None] | None = None,
        take_discards: Callable[[], list[BlockHash]] | None = None,
        delete_files: Callable[[list[BlockHash]], object] | None = None,
        keep_files: Callable[[set[BlockHash]], object] | None = None,
        block_bytes: int = 0,
        file_bytes: int = 0,
        cost: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        workers: int = 1,
    ) -> None:
        """`whole_keys`: the engine has several KV-cache groups (see the module's "Keys");
        `take_discards`: disk files the local tier let go of since the last job (the
        worker deletes them in order, before the job that may reuse their slots);
        `delete_files`: deletes disk files from here, for what must be gone before any
        job comes (a reset); `keep_files`: deletes every disk file but these (shutdown);
        `block_bytes`, `file_bytes`: one block's bytes, and its disk file's (metrics);
        `cost`: the load-or-recompute model deciding Redis hits (None: every hit is
        offered, as before it existed); `clock`: for how long a lookup has waited;
        `workers`: the engine's workers, each reporting its own copies (`_note_copies`)."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        # local store blocks whose CPU copy some workers reported done: how many so far
        self._copies: Counter[BlockHash] = Counter()
        self.whole_keys = whole_keys
        self._hash_of: Callable[[OffloadKey], BlockHash] = (
            whole_key if whole_keys else block_hash_of
        )
        self._key_of: Callable[[BlockHash], OffloadKey] = OffloadKey if whole_keys else key_of
        self.local = local
        lookup_one = getattr(local, "lookup_one", None)  # the CPU manager's, list-free
        self._local_hit: Callable[[BlockHash], bool] = lookup_one or (
            lambda block_hash: bool(local.lookup([block_hash]))
        )
        self.remote = remote
        self.enable_events = enable_events
        self._on_close = on_close
        self._take_discards = take_discards or list
        self._delete_files = delete_files
        self._keep_files = keep_files
        self._carried: list[BlockHash] = []  # discards taken early, still for the worker
        self.epoch = 0  # resets so far: Redis's key namespace, and the worker's (reset_cache)
        # vLLM completes a load with its keys as a set: loads are found by key set
        # (each load: the parts taken from each tier, and the blocks promoted locally)
        self._loads: defaultdict[frozenset[BlockHash], deque[_Load]]
        self._loads = defaultdict(deque)
        # kvtier's one join of local and remote tiers: write-through stores, promotions
        members = [(LOCAL, local)] if remote is None else [(LOCAL, local), (REMOTE, remote)]
        self.chain = TierChain(members, promote=False)
        self._found: OrderedDict[BlockHash, str] = OrderedDict()
        # what the connector told of each request in flight (see note_prompt)
        self.prompts = None if cost is None else Prompts(cost.tokens_per_block, self._hash_of)
        self._failed_stores: set[tuple[str, BlockHash]] = set()
        self._failed_loads: set[BlockHash] = set()
        self._to_forget: set[BlockHash] = set()
        self.load_failures = 0
        self.store_failures = 0
        if isinstance(local, CascadeOffloadingManager):
            tiers = {"cpu": block_status_core(local.cpu), "disk": block_status_core(local.disk)}
        else:
            tiers = {"cpu": block_status_core(local)}
        self._local_label = "disk" if "disk" in tiers else "cpu"
        # the CPU tier's block status under a disk tier: a local hit not ready there is
        # the disk's, decided by the cost model (None: no disk tier)
        self._cpu_core = tiers["cpu"] if "disk" in tiers else None
        self.cost = cost
        self.disk_runs = (
            None
            if self._cpu_core is None or cost is None or self.prompts is None
            else DiskRuns(
                cost, self._cpu_core, tiers["disk"], self.prompts, redis_follows=remote is not None
            )
        )
        self.clock = clock
        self.tier_stats = TierStats(
            tiers, block_bytes=block_bytes, file_bytes=file_bytes, remote=remote, cost=cost
        )
        for label in (self._local_label, *(("redis",) if remote is not None else ())):
            self.tier_stats.worker_gauges["store_queue_bytes", label] = 0  # (until a worker says)
        self._runs = (
            None
            if cost is None or remote is None
            else RemoteRuns(
                remote, cost, self.tier_stats, self._found, self._remember, lambda: self.clock()
            )
        )
        fetch_with = getattr(remote, "fetch_with", None)
        if cost is not None and fetch_with is not None:  # a slow Redis's lookups carry blocks
            fetch_with(partial(cost.prefetch_blocks, "redis"))

    def _tier(self, name: str) -> KvtierManager:
        manager = self.local if name == LOCAL else self.remote
        if manager is None:
            raise KeyError(f"no {name} tier configured")
        return manager

    # --- lookups and loads -------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        block_hash: BlockHash
        if self.whole_keys:
            block_hash = key  # the same bytes (see whole_key)
        elif key.endswith(GROUP_SUFFIX):
            block_hash = key[:-4]
        else:
            block_hash = block_hash_of(key)  # raises, naming the group
        if self.remote is None and self._cpu_core is None:  # the hot path: the CPU tier
            return _HIT if self._local_hit(block_hash) else _MISS
        use: _RequestUse | None = req_context.get_state(_RequestUse)
        if use is not None and block_hash in use.failed:
            return _MISS  # its load failed for this request: recomputed
        if self.remote is None:
            if not self._local_hit(block_hash):
                return _MISS
            return _HIT if self._disk_answer(block_hash, req_context, key) else _MISS
        if self._runs is not None:
            plan = plan_of(req_context)
            pos = plan.position(block_hash)
            if self._local_hit(block_hash):
                return self._local_answer(block_hash, req_context, key)
            if plan.end is None or pos >= plan.end:
                plan.end = self.prompts.end(key, req_context, pos) if self.prompts else None
            if plan.stored is None:  # the request's first Redis block (see `_stored_run`)
                plan.stored_run = self._stored_run(key, req_context)
            return self._runs.lookup(block_hash, plan, pos)
        if self._local_hit(block_hash):
            return self._local_answer(block_hash, req_context, key)
        if self._found.get(block_hash) == REMOTE:
            found: int | None = 1
        else:
            found = self.remote.lookup([block_hash])
            if found is None:
                return LookupResult.RETRY
        self.tier_stats.add("lookup_blocks", "redis", 1)
        if not found:
            return LookupResult.MISS
        self.tier_stats.add("hit_blocks", "redis", 1)
        return self._hit(block_hash, REMOTE)

    def note_prompt(self, req_id: str, num_tokens: int, chain: PromptChain | None = None) -> None:
        """The request's length and keys, from the connector before each of vLLM's
        lookups of it: what a Redis lookup could save is known from its first key (see
        `remote_runs`), and how much of it this engine stored (`_stored_run`)."""
        if self.prompts is not None and (self._runs is not None or self.disk_runs is not None):
            self.prompts.note(req_id, num_tokens, chain)

    def _stored_run(self, key: OffloadKey, req_context: ReqContext) -> int | None:
        """How many of the request's blocks from `key` on this engine stored in Redis
        itself (`stored_here`); None where not known (`Prompts.run_from`)."""
        stored_here = getattr(self.remote, "stored_here", None)
        if stored_here is None or self.prompts is None:
            return None
        return self.prompts.run_from(key, req_context, lambda h: bool(stored_here(h)))

    def _local_answer(
        self, block_hash: BlockHash, req_context: ReqContext, key: OffloadKey
    ) -> LookupResult:
        if self._disk_answer(block_hash, req_context, key):
            return self._hit(block_hash, LOCAL)
        return _MISS

    def _disk_answer(self, block_hash: BlockHash, req_context: ReqContext, key: OffloadKey) -> bool:
        """Whether a local hit is offered: always without a disk tier or a cost model,
        else as `DiskRuns.offered` decides."""
        runs = self.disk_runs
        return True if runs is None else runs.offered(block_hash, req_context, key)

    def step_seconds(self, steps: list[tuple[int, float]]) -> None:
        """Engine steps the workers timed: (tokens computed, seconds)."""
        if self.cost is not None:
            for tokens, seconds in steps:
                self.cost.observe_step(tokens, seconds)

    def held_lookups(self) -> AbstractContextManager[None]:
        """The Redis lookups of one request's walk, sent together when it ends (one
        round trip for the whole prompt: `AsyncLookups.held`)."""
        hold = getattr(self.remote, "held_lookups", None)
        return nullcontext() if hold is None else cast(AbstractContextManager[None], hold())

    def wait_lookups(self, timeout: float | None = None) -> bool:
        """Block (up to `timeout`) until the Redis tier's lookups in flight are answered."""
        wait = getattr(self.remote, "wait_lookups", None)
        return True if wait is None else bool(wait(timeout))

    def _hit(self, block_hash: BlockHash, tier: str) -> LookupResult:
        self._remember(block_hash, tier)
        return LookupResult.HIT

    def _remember(self, block_hash: BlockHash, tier: str) -> None:
        self._found[block_hash] = tier
        self._found.move_to_end(block_hash)
        if len(self._found) > MAX_REMEMBERED_HITS:
            self._found.popitem(last=False)

    def _where(self, block_hash: BlockHash) -> str:
        known = self._found.pop(block_hash, None)
        if known is not None:
            return known
        return LOCAL if self._local_hit(block_hash) else REMOTE

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> KvtierLoadSpec:
        hashes = [self._hash_of(k) for k in keys]
        where = (
            [self._where(h) for h in hashes] if self.remote is not None else [LOCAL] * len(hashes)
        )
        spec = KvtierLoadSpec(epoch=self.epoch)
        taken: list[tuple[str, list[BlockHash]]] = []
        try:
            for name in (LOCAL, REMOTE):
                positions = [i for i, w in enumerate(where) if w == name]
                if positions:
                    part = [hashes[i] for i in positions]
                    tier_spec = self._tier(name).prepare_load(part)
                    taken.append((name, part))
                    self._count_load(name, part, tier_spec)
                    spec.parts.append(Part(name, positions, part, tier_spec))
        except BaseException:  # a tier refused: unpin what the other took
            for name, part in taken:
                self._tier(name).complete_load(part)
            raise
        _use_of(req_context).loaded += hashes
        spec.deadline_s = self._load_deadline(spec.parts)
        spec.promotion = self._plan_promotion(spec.parts)
        spec.discards = self._next_discards()  # after the promotion's own disk evictions
        promoted = spec.promotion.block_hashes if spec.promotion is not None else []
        disk = sum(
            len(p.spec.disk_positions) for p in spec.parts if isinstance(p.spec, CascadeLoadSpec)
        )
        if self.disk_runs is not None:
            self.disk_runs.loading += disk
        self._loads[frozenset(hashes)].append((taken, promoted, disk))
        return spec

    def _load_deadline(self, parts: list[Part]) -> float | None:
        """How long the load may take before the worker gives it up (see
        `CostModel.load_deadline_s`; None: no deadline): by its slowest tier's estimate
        and all its blocks' recompute. A load from the CPU tier alone has one too: its
        copies queue behind the disk's in the cascade's one worker."""
        if self.cost is None or not parts:
            return None
        if self._cpu_core is None and all(p.tier == LOCAL for p in parts):
            return None  # the CPU tier alone: its copies wait on nothing
        tier = "cpu"
        for part in parts:
            if part.tier == REMOTE:
                tier = "redis"
            elif isinstance(part.spec, CascadeLoadSpec) and part.spec.disk_positions:
                tier = "disk" if tier == "cpu" else tier
        return self.cost.load_deadline_s(tier, sum(len(p.block_hashes) for p in parts))

    def _plan_promotion(self, parts: list[Part]) -> Part | None:
        """Local slots for what Redis serves, taken by the chain (a refused or full local
        tier just means no promotion)."""
        remote = next((p for p in parts if p.tier == REMOTE), None)
        if remote is None:
            return None
        out = self.chain.plan_promotion(0, remote.block_hashes)
        if out is None or not out.block_hashes_to_store:
            return None
        position = dict(zip(remote.block_hashes, remote.positions, strict=True))
        promoted = out.block_hashes_to_store
        return Part(LOCAL, [position[h] for h in promoted], promoted, out.store_spec)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._use([self._hash_of(k) for k in keys])

    def _use(self, hashes: list[BlockHash]) -> None:
        self.local.touch(hashes)
        if self.remote is not None:
            self.remote.touch(hashes)

    def on_request_finished(self, req_context: ReqContext) -> None:
        """A request that loaded blocks and stored none uses them now (see `_RequestUse`)."""
        if self.prompts is not None:
            self.prompts.forget(req_context.req_id)
        use = _use_of(req_context)
        if use.loaded:
            self._use(use.loaded)
            use.loaded = []

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        hashes = frozenset(self._hash_of(k) for k in keys)
        pending = self._loads.get(hashes)
        if not pending:
            raise KeyError(f"complete_load: no load in flight for these {len(hashes)} blocks")
        parts, promoted, disk = pending.popleft()
        if self.disk_runs is not None:
            self.disk_runs.loading -= disk
        if not pending:
            del self._loads[hashes]
        remote_ok = True
        for name, part in parts:
            failed = not self._failed_loads.isdisjoint(part)
            self._failed_loads.difference_update(part)
            if failed:
                _use_of(req_context).failed.update(part)
            remote_ok &= name != REMOTE or not failed
            tier = self._tier(name)
            if isinstance(tier, CascadeOffloadingManager):  # its promotions settle with it
                tier.complete_load(part, success=not failed)
            else:
                tier.complete_load(part)
        if promoted:
            bad = {h for h in promoted if (LOCAL, h) in self._failed_stores}
            self._failed_stores.difference_update((LOCAL, h) for h in bad)
            self.chain.settle_promotion(0, promoted, remote_ok and not bad)
        self._forget()

    # --- stores --------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        hashes = [self._hash_of(k) for k in keys]
        use = _use_of(req_context)
        self._use(use.loaded + hashes)  # the request's blocks head to tail, then its stores
        use.loaded = []
        out = self.chain.prepare_store(hashes)  # offered to every tier (write-through)
        if out is None:
            return None
        # positions in vLLM's order of the keys, which is the order of its device blocks
        stored = set(out.block_hashes_to_store)
        order: dict[BlockHash, int] = {}
        for h in hashes:
            if h in stored:
                order.setdefault(h, len(order))
        spec = KvtierStoreSpec(discards=self._next_discards(), epoch=self.epoch)
        for name, part, tier_spec in cast(ChainSpec, out.store_spec).parts:
            if part:
                spec.parts.append(Part(name, [order[h] for h in part], part, tier_spec))
        return PrepareStoreOutput(
            keys_to_store=[self._key_of(h) for h in order],
            store_spec=spec,
            evicted_keys=[self._key_of(h) for h in out.block_hashes_evicted],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        hashes = [self._hash_of(k) for k in keys]
        if self._copies:  # a worker whose copy failed never reported it: not counted on
            for h in hashes:
                self._copies.pop(h, None)
        for name, _ in self.chain.tiers:  # each tier's part as the worker said it went
            failed = {h for h in hashes if (name, h) in self._failed_stores}
            self._failed_stores.difference_update((name, h) for h in failed)
            if success and len(failed) < len(hashes):
                ok = [h for h in hashes if h not in failed]
                settled = self.chain.complete_part(name, ok, True)
                if name == REMOTE:
                    self.tier_stats.add("store_blocks", "redis", len(settled))
            if failed or not success:
                self.chain.complete_part(name, list(failed) if success else hashes, False)
        self._forget()  # (demotions the worker lost, pinned until this store completed)

    # --- what the worker found -------------------------------------------

    def apply_worker_report(self, report: WorkerReport) -> None:
        """Failures seen by the worker, applied before vLLM completes their jobs."""
        self._count_report(report)
        for name, hashes in report.failed_stores.items():
            self.store_failures += 1
            self._failed_stores.update((name, h) for h in hashes)
            log.warning("kvtier: a %s store of %d blocks failed (not kept)", name, len(hashes))
        for name, hashes in report.shed_stores.items():  # a tier behind: not kept, no error
            self._failed_stores.update((name, h) for h in hashes)
        for hashes in report.failed_loads:
            self.load_failures += 1
            self._failed_loads.update(hashes)
            log.warning("kvtier: a load of %d blocks failed; vLLM recomputes them", len(hashes))
        if report.corrupt_blocks:
            log.warning("kvtier: %d corrupt disk blocks dropped", len(report.corrupt_blocks))
        self._to_forget.update(report.corrupt_blocks + report.lost_demotions)
        self._forget()
        if report.copied:
            self._note_copies(report.copied)

    def _note_copies(self, copied: list[tuple[int, BlockHash]]) -> None:
        """Local store blocks whose CPU copy every worker has done while their disk writes
        go on (each worker copies its own shard): readable from the CPU tier now
        (`CascadeOffloadingManager.complete_copy`). A copy of an earlier reset epoch is
        not of this epoch's block of the same hash."""
        complete_copy = getattr(self.local, "complete_copy", None)
        if complete_copy is None:
            return
        ready = []
        for epoch, block_hash in copied:
            if epoch != self.epoch:
                continue
            self._copies[block_hash] += 1
            if self._copies[block_hash] >= self.workers:
                del self._copies[block_hash]
                ready.append(block_hash)
        if ready:
            complete_copy(ready)

    def _count_report(self, report: WorkerReport) -> None:
        """The report's part of the per-tier metrics (local store failures and the
        rest are counted by the managers themselves)."""
        add = self.tier_stats.add
        for timed, seconds in report.seconds.items():
            tier, direction = timed.split(":")
            add(f"{direction}_time", tier, seconds)
        add("store_failures", "redis", len(report.failed_stores.get(REMOTE, ())))
        for hashes in report.failed_loads:
            add("load_failures", self._load_tier(hashes), len(hashes))
        add("corrupt_blocks", "disk", len(report.corrupt_blocks))
        add("corrupt_blocks", "redis", report.remote_corrupt)
        add("store_failures", "disk", len(report.lost_demotions))
        for name, hashes in report.shed_stores.items():
            add("shed_blocks", "redis" if name == REMOTE else self._local_label, len(hashes))
        for tier, blocks in report.expired_loads.items():
            add("load_expired_blocks", tier, blocks)
        for name, nbytes in report.queued_bytes.items():
            if name == LOCAL or self.remote is not None:
                label = "redis" if name == REMOTE else self._local_label
                self.tier_stats.worker_gauges["store_queue_bytes", label] = nbytes
        if self.cost is not None:
            for tier, blocks, seconds in report.loads:
                self.cost.observe_load(tier, blocks, seconds)
            self.step_seconds(report.steps)

    def _count_load(self, name: str, part: list[BlockHash], spec: object) -> None:
        add = self.tier_stats.add
        if name == REMOTE:
            add("load_blocks", "redis", len(part))
        elif isinstance(spec, CascadeLoadSpec):  # (the disk manager also counts demotion pins)
            add("load_blocks", "cpu", len(spec.cpu_positions))
            add("load_blocks", "disk", len(spec.disk_positions))
        else:
            add("load_blocks", "cpu", len(part))

    def _load_tier(self, hashes: list[BlockHash]) -> str:
        """The tier a failed load part read (its blocks are still pinned by the load)."""
        for queued in self._loads.values():
            for taken, _, _ in queued:
                for name, part in taken:
                    if hashes and hashes[0] in part:
                        return "redis" if name == REMOTE else self._local_label
        return self._local_label

    def get_stats(self) -> OffloadingConnectorStats:
        """Per-tier counters, occupancy and Redis lookup times for vLLM's `/metrics`."""
        return self.tier_stats.take()

    def _forget(self) -> None:
        """Drop lost disk blocks. One still pinned goes once its pin is let go, tried again
        at each completion: by its failed load, or by the store whose job demoted it (a
        demotion is readable on disk at once, pinned until that job completes, and the
        worker reports it lost while the job is in flight: a shed store's, a failed write's)."""
        if self._to_forget and isinstance(self.local, CascadeOffloadingManager):
            local = self.local
            removed = set(local.discard_disk_blocks(list(self._to_forget)))
            self._to_forget = {h for h in self._to_forget if h not in removed and local.on_disk(h)}

    def _next_discards(self) -> list[BlockHash]:
        carried, self._carried = self._carried, []
        return carried + self._take_discards()

    # --- events, lifecycle ---------------------------------------------------

    def reset_cache(self) -> None:
        """vLLM's prefix-cache reset (`reset_prefix_cache(reset_connector=True)`, after a
        weight update): no block stored before it is served by this engine again.

        CPU slots are freed and disk blocks forgotten at once, and their files deleted
        from here before the call returns, so that not even a crash right after can
        bring them back; the worker hears of them with the next job (its byte budget).
        The shared tier moves to the next key epoch (`epoch_salt`): keys written before
        are never read again, and Redis evicts them as they age. vLLM drops every job
        of before the reset (never completing it here) and has the worker finish them
        before any later job reuses their slots; what those jobs write to disk is
        deleted by the discards that precede the next job in the worker's queue.
        """
        reset_tier(self.local)
        self.epoch += 1
        if self.remote is not None:
            reset = getattr(self.remote, "reset_cache", None)
            if reset is None:
                raise TypeError(f"{type(self.remote).__name__} cannot reset its key epoch")
            reset(epoch_salt(self.epoch))
        self._loads.clear()
        if self.disk_runs is not None:
            self.disk_runs.loading = 0
        self.chain.forget()
        self._found.clear()
        self._failed_stores.clear()
        self._failed_loads.clear()
        self._to_forget.clear()
        self._copies.clear()
        discards = self._next_discards()
        if self._delete_files is not None:
            self._delete_files(discards)
        self._carried = discards

    def take_events(self) -> Iterable[OffloadingEvent]:
        tiers = [self.local] if self.remote is None else [self.local, self.remote]
        for tier in tiers:
            for event in tier.take_events():
                if not self.enable_events:
                    continue
                medium, locality = _MEDIA.get(event.medium, (Medium.STORAGE, Locality.LOCAL))
                yield OffloadingEvent(
                    keys=[self._key_of(h) for h in event.block_hashes],
                    medium=medium,
                    removed=event.removed,
                    locality=locality,
                )

    def shutdown(self) -> None:
        """vLLM shuts the worker down first (it has flushed the CPU tier to disk by then):
        the disk directory is left holding exactly the blocks this side knows, in the
        CPU tier or on disk. Files the worker was never told to delete (evictions since
        the last job, a reset with no job after it, blocks the flush wrote from slots a
        reset let go of) would otherwise come back at a restart. The load-or-recompute
        decisions and estimates are logged once (what `/metrics` showed last, for a run
        with no scraper: an engine test's log says why a prompt was recomputed)."""
        cost = self.cost
        if cost is not None and (gauges := cost.gauges()):
            decisions = {f"{tier}:{way}": n for (tier, way), n in cost.decisions.items()}
            estimates = {f"{key}:{tier}": round(v, 6) for (key, tier), v in gauges.items()}
            log.info("kvtier: load decisions %s; estimates %s", decisions, estimates)
        if self._keep_files is not None and isinstance(self.local, CascadeOffloadingManager):
            discards = self._next_discards()
            try:  # never keep vLLM from stopping
                try:
                    keep = set(self.local.held_keys())
                except NotImplementedError as exc:  # a policy that cannot list its keys
                    log.warning("kvtier: only evicted disk blocks deleted at shutdown: %s", exc)
                    if self._delete_files is not None:
                        self._delete_files(discards)
                else:
                    self._keep_files(keep)
            except OSError as exc:
                log.warning("kvtier: disk directory not tidied at shutdown: %s", exc)
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
