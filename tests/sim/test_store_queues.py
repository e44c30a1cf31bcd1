"""The replay's store queues (`kvtier.sim.store_queues`): a tier member that falls behind
sheds stores, counted per tier in the replay's JSON, never as errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.cli import main
from kvtier.sim.replay_config import ReplayConfig, TimeModel
from kvtier.sim.run import replay
from kvtier.sim.store_queues import StoreQueueModel, StoreQueues
from kvtier.sim.traces import TraceRequest
from kvtier.sim.workload import Workload


class QueueMachine(RuleBasedStateMachine):
    """Against a reference that keeps every admitted job with its finish time: a job is
    shed exactly when the member is busy and the blocks still to write, its own added,
    exceed the bound; admitted jobs are written one after another, at the member's rate."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.model = StoreQueueModel(
            local_ms_per_block=2.0, remote_ms_per_block=5.0, local_max_blocks=8
        )
        self.queues = StoreQueues(self.model, lambda: self.now)
        self.jobs: dict[str, list[tuple[float, float, int]]] = {"local": [], "remote": []}

    def _left(self, member: str) -> float:
        """Blocks the reference member has still to write at `now`."""
        ms = getattr(self.model, f"{member}_ms_per_block")
        return sum(
            min(blocks, max(end - self.now, 0.0) / ms)
            for _, end, blocks in self.jobs[member]
            if end > self.now
        )

    @rule(ms=st.floats(min_value=0, max_value=50, allow_nan=False))
    def wait(self, ms: float) -> None:
        self.now += ms

    @rule(member=st.sampled_from(["local", "remote"]), blocks=st.integers(1, 12))
    def store(self, member: str, blocks: int) -> None:
        ms = getattr(self.model, f"{member}_ms_per_block")
        bound = getattr(self.model, f"{member}_max_blocks")
        left = self._left(member)
        expect = bound is None or left <= 1e-9 or left + blocks <= bound + 1e-9
        assert self.queues.admit(member, blocks) is expect
        if expect:
            start = max([self.now] + [end for _, end, _ in self.jobs[member]])
            self.jobs[member].append((start, start + blocks * ms, blocks))

    @invariant()
    def unbounded_member_never_sheds(self) -> None:
        assert self.queues.admit("remote", 0)


TestStoreQueues = QueueMachine.TestCase
TestStoreQueues.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize(
    ("rates", "bounds", "message"),
    [
        ("gpu=1", "", "'gpu=1'; allowed: local=MS, remote=MS"),
        ("local", "", "'local'; allowed"),
        ("local=fast", "", "local='fast'; milliseconds"),
        ("local=-1", "", "local_ms_per_block=-1.0; a finite number of milliseconds >= 0"),
        ("local=inf", "", "local_ms_per_block=inf; a finite number"),
        ("", "remote=0", "remote_max_blocks=0; a whole number of blocks >= 1"),
        ("", "remote=2.5", "remote='2.5'; a whole number of blocks"),
        ("", "cpu=4", "'cpu=4'; allowed: local=BLOCKS, remote=BLOCKS"),
    ],
)
def test_bad_input_names_the_value_and_what_is_allowed(
    rates: str, bounds: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StoreQueueModel.parse(rates, bounds)


def _burst(n: int, blocks: int = 6) -> Workload:
    """`n` requests of distinct blocks arriving 1 ms apart: their stores pile up."""
    rows = tuple(
        TraceRequest(float(i), blocks * 4, 10, tuple(range(i * blocks, (i + 1) * blocks)))
        for i in range(n)
    )
    return Workload("burst", rows, 4, chained=True)


def test_a_member_that_falls_behind_sheds_and_the_tier_keeps_nothing_of_it() -> None:
    w = _burst(20)
    base = ReplayConfig(gpu_blocks=64, cpu_blocks=400, time_model=TimeModel())
    kept = replay(w, base)
    slow = StoreQueueModel(local_ms_per_block=5.0, local_max_blocks=12)
    shed = replay(w, ReplayConfig(**{**base.__dict__, "store_queues": slow}))
    _, cpu_kept = kept.tiers
    _, cpu = shed.tiers
    assert cpu_kept.shed_blocks == 0 and cpu_kept.stores == 120
    assert cpu.shed_blocks > 0 and cpu.errors == 0  # shed, never an error
    assert cpu.stores + cpu.shed_blocks == 120  # each block stored or shed, once
    fast = StoreQueueModel(local_ms_per_block=0.01, local_max_blocks=12)  # keeps up
    assert replay(w, ReplayConfig(**{**base.__dict__, "store_queues": fast})).tiers[1] == (cpu_kept)


def test_store_queues_need_the_virtual_clock() -> None:
    with pytest.raises(ValueError, match="need time_model"):
        ReplayConfig(store_queues=StoreQueueModel(local_ms_per_block=1.0))


def test_the_replay_json_counts_shed_blocks_under_the_engine_metric(
    capsys: pytest.CaptureFixture[str],
) -> None:
    replay_argv = ["replay", "--json", "--limit", "300", "--policy", "lru"]
    replay_argv += ["--gpu-blocks", "200", "--cpu-blocks", "400", "--concurrent"]
    queues = ["--store-ms-per-block", "local=50", "--store-queue-blocks", "local=16"]
    assert main(replay_argv + queues) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    shed = result["tiers"]["cpu"]["shed_blocks"]
    assert shed > 0 and result["metrics"]["vllm:kvtier_shed_blocks_total"] == {"cpu": shed}
    assert main(replay_argv) == 0  # no queue flags: nothing shed
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["tiers"]["cpu"]["shed_blocks"] == 0
    assert main([a for a in replay_argv if a != "--concurrent"] + queues) == 2
    assert "add --concurrent" in capsys.readouterr().err


def test_a_shed_stores_demotion_counts_in_the_queue_and_is_lost() -> None:
    """With `demote`, a store into a full CPU tier evicts blocks whose write to disk rides
    on it: those count in the local member's queue, as in an engine, and a store shed for
    them loses its demotion (the cascade forgets the blocks, as the engine's scheduler
    does when its worker reports them lost). Request 0's blocks, demoted by request 1's
    store, come back last: from disk when nothing is shed, a miss when that store was."""
    burst = _burst(20)
    back = TraceRequest(1000.0, 24, 10, tuple(range(6)))
    w = Workload("burst and back", (*burst.requests, back), 4, chained=True)
    base = ReplayConfig(cpu_blocks=6, disk_blocks=400, time_model=TimeModel())
    kept = replay(w, base)
    slow = StoreQueueModel(local_ms_per_block=5.0, local_max_blocks=12)
    shed = replay(w, ReplayConfig(**{**base.__dict__, "store_queues": slow}))
    (_, disk_kept), (cpu, disk) = kept.tiers, shed.tiers
    assert disk_kept.hit_blocks == 6 and disk_kept.dropped_blocks == 0
    assert disk.shed_blocks > 0  # (12 of a member's bound: 6 blocks and their demotion)
    assert disk.dropped_blocks > 0 and disk.hit_blocks == 0
    # every block the CPU tier evicted reached the disk, or was lost with its store
    assert disk.stores + disk.dropped_blocks == cpu.evictions
