"""Which of a request's disk blocks vLLM is offered: the load-or-recompute decision for
the disk tier at the vLLM boundary (`kvtier.connector.cost_model` makes it; this module
applies it, as `remote_runs` does for Redis).

The disk has no round trip to amortise, but its reads are shared: a run of disk blocks
waits for the disk blocks of the loads already in flight. One decision per request, at
its first block only the disk holds, stands for the rest of its disk blocks (a decline
is a miss, where vLLM's prefix ends). A block being stored to the CPU tier (not ready
there) is the disk's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from kvtier.connector.cost_model import CostModel
from kvtier.offload.cascade_manager import block_ready
from kvtier.types import BlockHash
from kvtier.vllm.offloading.prompt_keys import Prompts, request_state


@dataclass
class DiskRun:
    """A request's decision for the blocks only the disk tier holds, made at the first of
    them, and the blocks already counted (vLLM may ask the prompt again on a later step)."""

    load: bool | None = None
    counted: set[BlockHash] = field(default_factory=set)


class DiskRuns:
    """Decides a request's disk runs. `cpu_core`, `disk_core`: the cascade's block
    status of each tier; `prompts`: what the connector told of each request;
    `redis_follows`: a Redis tier is below the disk (it may hold what follows a local
    run). `loading`: the disk blocks of the loads in flight, kept by the manager."""

    def __init__(
        self,
        cost: CostModel,
        cpu_core: Any,
        disk_core: Any,
        prompts: Prompts,
        redis_follows: bool = False,
    ) -> None:
        self.cost = cost
        self.cpu_core = cpu_core
        self.disk_core = disk_core
        self.prompts = prompts
        self.redis_follows = redis_follows
        self.loading = 0

    def offered(self, block_hash: BlockHash, req_context: ReqContext, key: OffloadKey) -> bool:
        """Whether a local hit is offered: always from the CPU tier; from the disk only
        where loading the request's run beats recomputing it (`worth_loading`), or as a
        probe (`CostModel.probe`)."""
        if block_ready(self.cpu_core, block_hash):
            return True
        run = request_state(req_context, DiskRun)
        if run.load is None:
            run.load = self.worth_loading(key, req_context) or self.cost.probe("disk")
        if block_hash not in run.counted:
            run.counted.add(block_hash)
            self.cost.decisions["disk", "load" if run.load else "recompute"] += 1
        return run.load

    def worth_loading(self, key: OffloadKey, req_context: ReqContext) -> bool:
        """Whether the request's local run from `key` on is worth loading: the read of its
        disk blocks (those not ready in the CPU tier), behind the disk blocks of the loads
        already in flight, against recomputing the whole run (declined at its first disk
        block, vLLM recomputes from there; what follows the run is recomputed either way,
        unless a Redis tier may hold it: then to the prompt's end). The run is read from
        the prompt's keys (`Prompts.run_from`); where only the prompt's length is known,
        it is taken to reach the prompt's end, all of it on disk (judged kindly: a queue
        counted against a run four blocks long was weighed against ten); where neither
        is (vLLM's own connector), per block, with no queue. Judged per block alone, a
        saturated engine's loads were all decided and queued behind each other past
        their deadlines (50 ms a block file: 192 blocks given up in one run)."""
        cost, prompts = self.cost, self.prompts
        on_disk = 0  # of the run's blocks, those to read from the disk

        def holds(block_hash: BlockHash) -> bool:
            nonlocal on_disk
            if block_ready(self.cpu_core, block_hash):
                return True
            if block_ready(self.disk_core, block_hash):
                on_disk += 1
                return True
            return False

        run = prompts.run_from(key, req_context, holds)
        if run is not None and on_disk:
            if self.redis_follows:  # a decline loses what Redis may hold after the run
                run = max(run, prompts.blocks_to_end(key, req_context) or run)
            return cost.worth_loading("disk", on_disk, queued=self.loading, saves=run)
        blocks = prompts.blocks_to_end(key, req_context)
        if blocks is None:
            return cost.worth_loading("disk", 1)
        return cost.worth_loading("disk", blocks, queued=self.loading)
