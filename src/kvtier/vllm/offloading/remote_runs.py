"""Which of a request's Redis blocks vLLM is offered: the load-or-recompute decision at
the vLLM boundary (`kvtier.connector.cost_model` makes it; this module applies it).

vLLM asks the scheduler side about one key at a time, walking a request's blocks in
order, and asks again on a later step while any answer is RETRY. A Redis run is decided
as a whole (a round trip is paid once per run, so only the whole run is worth loading
or not), from what an earlier pass over the prompt listed (`LookupPlan`, kept in the
request's context) and the background lookups' answers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvtier.connector.cost_model import CostModel
from kvtier.offload.abstract import OffloadingManager as KvtierManager
from kvtier.types import BlockHash
from kvtier.vllm.offloading.job_specs import REMOTE
from kvtier.vllm.offloading.prompt_keys import request_state
from kvtier.vllm.offloading.tier_stats import TierStats


@dataclass
class LookupPlan:
    """One request's lookups, for deciding its Redis run as a whole (vLLM asks key by
    key): the keys in the order asked (an earlier pass over the prompt, whose Redis
    answers were not in yet, lists the keys after the one asked now), the answers taken
    from the Redis tier in this pass (its hits are also kept in the manager's `_found`,
    its misses are asked again in the next pass), and where this pass stands: the first
    block it offered from Redis, and whether it left the rest to recompute. `end`: one
    past the prompt's last key (in `keys`' positions), where the connector told the
    prompt's length (`KvtierOffloadingManager.note_prompt`): what a lookup could save is
    then known from the first key asked, before any later key is listed."""

    keys: list[BlockHash] = field(default_factory=list)
    index: dict[BlockHash, int] = field(default_factory=dict)
    answers: dict[BlockHash, int] = field(default_factory=dict)
    start: int | None = None  # this pass's first block offered from Redis
    declined: bool = False  # this pass leaves the rest to recompute
    deferred: bool = False  # this pass waits for Redis answers (vLLM asks again later)
    last: int = -1
    passes: int = 1
    waiting_since: float | None = None
    # the number of the lookups' round trip on its way when it began to wait, before it
    # asked (its questions wait behind that one; `RemoteRuns._behind_s`), None: none was
    behind: int | None = None
    end: int | None = None
    observed: bool = False  # its first Redis answer went into the tier's hit share
    # this engine stored the first block it asks Redis about (which hit share applies:
    # `CostModel.hit_share`); None until that block is known
    stored: bool | None = None
    # how many blocks from that first one on this engine stored (`stored_run`); None:
    # not known (the connector gave no keys)
    stored_run: int | None = None
    # it waits and loads to measure a tier whose loads are not worth waiting for (None:
    # not decided; see `RemoteRuns.lookup`)
    probe: bool | None = None
    # positions whose decision is counted (`decided`): vLLM asks a waiting request
    # again on every step it cannot schedule it, and each pass decides again
    counted: set[int] = field(default_factory=set)

    def blocks_to_find(self, pos: int, stored: bool) -> int:
        """What a lookup from `pos` could find: the prompt's blocks from there on
        (`blocks_left`), and of a run this engine stored, no more than it stored: a
        conversation's next turn finds its history, not its new part, and waiting for
        its lookup as if the whole prompt could come back held second turns 0.25 s to
        save 0.18 (a bench_serving run, Redis 200 ms away)."""
        blocks = self.blocks_left(pos)
        return min(blocks, self.stored_run) if stored and self.stored_run else blocks

    def blocks_left(self, pos: int) -> int:
        """The prompt's blocks from `pos` on: from its length where known, else those
        listed so far (a first pass lists them as it goes)."""
        end = len(self.keys) if self.end is None else max(self.end, len(self.keys))
        return max(end - pos, 1)

    def decided(self, pos: int, num_blocks: int) -> int:
        """How many of the `num_blocks` from `pos` on are decided for the first time in
        this request (each block counts once in `CostModel.decisions`, at its first
        decision, however many passes vLLM makes)."""
        new = [p for p in range(pos, pos + num_blocks) if p not in self.counted]
        self.counted.update(new)
        return len(new)

    def position(self, block_hash: BlockHash) -> int:
        pos = self.index.get(block_hash)
        if pos is None:
            pos = self.index[block_hash] = len(self.keys)
            self.keys.append(block_hash)
        elif pos <= self.last:  # vLLM asks the prompt again from its start (a later step):
            self.passes += 1  # decide again, on what is known now (misses asked again)
            self.start, self.declined, self.deferred = None, False, False
            self.answers.clear()
        self.last = pos
        return pos


def plan_of(req_context: ReqContext) -> LookupPlan:
    return request_state(req_context, LookupPlan)


# first keys of requests that went on without their Redis answer, watched for it (the
# hit share must see the answers of the requests that did not wait, or a share that
# fell to 0 would never rise again), with whether this engine stored them
MAX_WATCHED = 64


class RemoteRuns:
    """Decides a request's Redis runs. `found`: the manager's memory of where recent
    lookups found each block (a Redis answer is handed out once), which `remember`
    adds to; `clock`: for how long a request has waited on its lookups."""

    def __init__(
        self,
        remote: KvtierManager,
        cost: CostModel,
        stats: TierStats,
        found: Mapping[BlockHash, str],
        remember: Callable[[BlockHash, str], None],
        clock: Callable[[], float],
    ) -> None:
        self.remote = remote
        self.cost = cost
        self.tier_stats = stats
        self._found = found
        self._remember_in = remember
        self.clock = clock
        self._watched: OrderedDict[BlockHash, bool] = OrderedDict()

    def _remember(self, block_hash: BlockHash) -> None:
        self._remember_in(block_hash, REMOTE)

    def lookup(self, block_hash: BlockHash, plan: LookupPlan, pos: int) -> LookupResult:
        """A block the local tier lacks: offered from Redis only while loading this pass's
        Redis run (from its first block to the last one known) is predicted faster than
        recomputing it (`cost_model`). Where it may be, but not yet known to be, the
        request waits for the answers (of the keys an earlier pass listed), no longer than
        they could save. A run worth loading at its first block is worth loading whole (a
        longer run pays the same round trip), so answers given stay right as more come,
        and the run is walked once per pass (at its first block), not once per block."""
        cost = self.cost
        if plan.declined:
            return self._answer(block_hash, False)
        if plan.start is not None or plan.deferred:  # decided (or waiting) at the run's start
            found = self._answer_of(plan, block_hash)
            if found is None or plan.deferred:
                return LookupResult.RETRY
            if found:
                cost.decisions["redis", "load"] += plan.decided(pos, 1)
            return self._answer(block_hash, bool(found))
        self._collect_watched()
        stored = self._stored_here(plan, pos)
        if plan.waiting_since is None:  # before it asks: a round trip on its way is another's
            trip = self._trip_in_flight()
            plan.behind = None if trip is None else trip[0]
        for attempt in (0, 1):
            ahead, pending = self._known_run(plan, pos)
            self._observe_first(plan, pos)
            self.tier_stats.pull_lookup_seconds()  # the round trips so far, for the estimate
            # (a run declined with every answer in counts toward the tier's next probe)
            if ahead and (
                cost.worth_loading("redis", ahead, self._prefetched(plan, pos, ahead))
                or (not pending and (plan.probe or cost.probe("redis")))
            ):
                plan.start = pos
                cost.decisions["redis", "load"] += plan.decided(pos, 1)
                return self._answer(block_hash, True)
            if not (pending and attempt == 0 and self._wait_in_place(plan, pos, stored)):
                break
        if pending:
            now = self.clock()
            if plan.waiting_since is None:
                plan.waiting_since = now
            blocks = plan.blocks_to_find(pos, stored)
            found = bool(plan.answers.get(plan.keys[pos]))  # Redis holds the run's head
            behind = self._behind_s(plan)
            # before the prompt's length is known, a first pass cannot tell what the
            # lookup could save: it lists the prompt's keys and asks them all
            budget = cost.wait_budget_s("redis", blocks, found, stored)
            patient = (plan.end is None and plan.passes < 2) or not (
                cost.lookup_too_slow("redis", blocks, behind_s=behind, budget_s=budget)
                or now - plan.waiting_since > budget
            )
            if not patient and not cost.worth_loading("redis", blocks):
                # loads predicted slower than recomputing are not waited for, so they
                # would never be measured again (an estimate raised by loads given up on
                # a saturated engine stayed there): every PROBE_EVERY-th such request
                # waits, two round trips at most, and loads its run (`CostModel.probe`)
                if plan.probe is None:
                    plan.probe = cost.probe("redis")
                patient = plan.probe and now - plan.waiting_since <= cost.probe_wait_s("redis")
            if patient:
                plan.deferred = True
                return LookupResult.RETRY
            # waited as long as the lookup could save: the request goes on without it;
            # the questions stay asked, and their answers serve later requests
            ahead = blocks
            if not plan.observed:
                plan.observed = True
                self._watched[plan.keys[pos]] = stored
                if len(self._watched) > MAX_WATCHED:
                    self._watched.popitem(last=False)
        if ahead:
            cost.decisions["redis", "recompute"] += plan.decided(pos, ahead)
            plan.declined = True
        return self._answer(block_hash, False)

    def _trip_in_flight(self) -> tuple[int, float] | None:
        in_flight = getattr(self.remote, "lookup_in_flight", None)
        return None if in_flight is None else in_flight()

    def _behind_s(self, plan: LookupPlan) -> float:
        """How long the round trip that was on its way when the request began to wait,
        and still is, has taken (0: none was, or it ended): the request's questions
        were asked after it started, and wait for it to end. Its own round trip is no
        such bound: it is what the request waits on, for at most its whole budget."""
        trip = self._trip_in_flight()
        if trip is None or plan.behind is None or trip[0] != plan.behind:
            return 0.0
        return trip[1]

    def _stored_here(self, plan: LookupPlan, pos: int) -> bool:
        """Whether this engine stored the pass's first Redis block itself (decided once a
        request: the hit share it is judged by, `CostModel.hit_share`)."""
        if plan.stored is None:
            stored_here = getattr(self.remote, "stored_here", None)
            plan.stored = bool(stored_here is not None and stored_here(plan.keys[pos]))
        return plan.stored

    def _prefetched(self, plan: LookupPlan, pos: int, num_blocks: int) -> int:
        """How many of the run's blocks its lookup read whole (`prefetch`): a load of them
        costs no round trip."""
        count = getattr(self.remote, "prefetched", None)
        return 0 if count is None else int(count(plan.keys[pos : pos + num_blocks]))

    def _observe_first(self, plan: LookupPlan, pos: int) -> None:
        """The request's first Redis answer, once it is in, into the tier's hit share."""
        if not plan.observed:
            found = plan.answers.get(plan.keys[pos])
            if found is not None:
                plan.observed = True
                self.cost.observe_lookup("redis", bool(found), bool(plan.stored))

    def _collect_watched(self) -> None:
        """The answers come in for requests that went on without them (see MAX_WATCHED)."""
        peek = getattr(self.remote, "peek_lookup", None)
        if peek is None or not self._watched:
            return
        for block_hash, stored in list(self._watched.items()):
            found = peek([block_hash])
            if found is not None:
                del self._watched[block_hash]
                self.cost.observe_lookup("redis", bool(found), stored)

    def _wait_in_place(self, plan: LookupPlan, pos: int, stored: bool) -> bool:
        """Wait here, on the scheduler's thread, for the answer to the key at `pos` (a
        round trip of a fast tier) rather than have vLLM ask again a step later (see
        `CostModel.sync_wait_s`); whether it waited. Only for the first key a pass asks
        Redis about and only where the prompt's length is known: a cold prompt's miss
        is then final at once, and a hit defers the request as before while the keys
        after it are listed and asked in one round trip."""
        # (`_known_run` has just asked for the answer, and kept it if it was in)
        if plan.end is None or pos + 1 < len(plan.keys) or plan.keys[pos] in plan.answers:
            return False
        waited = 0.0 if plan.waiting_since is None else self.clock() - plan.waiting_since
        timeout = self.cost.sync_wait_s("redis", plan.blocks_to_find(pos, stored), waited, stored)
        wait = getattr(self.remote, "wait_lookups", None)
        if timeout <= 0 or wait is None:
            return False
        wait(timeout)
        return True

    def _known_run(self, plan: LookupPlan, pos: int) -> tuple[int, bool]:
        """How many keys from `pos` on Redis holds by the answers in, and whether the run
        may go on past them: an answer is still out, or (a first pass over the prompt)
        no key after them has been asked yet."""
        run = 0
        for h in plan.keys[pos:]:
            found = self._answer_of(plan, h)
            if found is None:
                return run, True
            if not found:
                return run, False
            run += 1
        return run, plan.passes < 2  # every key listed so far is there: more may follow

    def _answer_of(self, plan: LookupPlan, block_hash: BlockHash) -> int | None:
        """Redis's answer for one block (1 or 0), None while it is not in (asked now if
        it was not yet). An answer is handed out once: kept for this pass, and a hit
        beyond (see `_found`)."""
        found = plan.answers.get(block_hash)
        if found is None:
            if self._found.get(block_hash) == REMOTE:
                found = 1
            else:
                found = self.remote.lookup([block_hash])
                if found is None:
                    return None
                if found:
                    self._remember(block_hash)
            plan.answers[block_hash] = found
        return found

    def _answer(self, block_hash: BlockHash, offered: bool) -> LookupResult:
        """A block's final answer within a decided run (counted as the tier's lookup)."""
        self.tier_stats.add("lookup_blocks", "redis", 1)
        if not offered:
            return LookupResult.MISS
        self.tier_stats.add("hit_blocks", "redis", 1)
        self._remember(block_hash)
        return LookupResult.HIT
