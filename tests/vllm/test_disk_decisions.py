"""Load or recompute for the disk tier, and a deadline on every load of the cascade, with
real components: kvtier's scheduler side and worker as `KvtierConnector` builds them,
over a real disk directory. The recompute cost is given to the model as engine steps
would give it; a stalled disk is the disk store's I/O hook waiting on an event."""

from __future__ import annotations

import contextlib
import threading
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvtier.connector.cost_model import PROBE_EVERY
from tests.remote.conftest import serve_redis
from tests.vllm.test_offloading_spec import BLOCK_BYTES, TOKENS, Engine, engines, keys_of

with_engines = engines  # the fixture, under this module's name too

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext  # noqa: E402

from kvtier.offload.tier_metrics import METRICS  # noqa: E402
from kvtier.vllm.offloading.prompt_keys import PromptChain  # noqa: E402


def disk_engine(
    engines: list[Engine], tmp_path: Path, cpu_blocks: int = 2, **extra: object
) -> tuple[Engine, list[bytes]]:
    """Six blocks written through to disk, loaded back head first: the disk holds all
    six, the CPU tier (two blocks by default) the first two (the load promoted them)."""
    engine = Engine(
        {
            "cpu_bytes_to_use": cpu_blocks * BLOCK_BYTES,
            "disk_path": str(tmp_path / "disk"),
            "disk_bytes_to_use": 64 * (BLOCK_BYTES + 128),
            "disk_writes": "write_through",
        }
        | extra
    )
    engines.append(engine)
    keys = keys_of(6, start=900)
    engine.compute(list(range(6)), seed=5)
    engine.store(keys, list(range(6)))
    errors, _ = engine.load(keys[:2], [10, 11])
    assert not errors
    assert in_cpu(engine, keys)[:2] == [True, True]
    return engine, keys


def in_cpu(engine: Engine, keys: list[bytes]) -> list[bool]:
    cpu = engine.manager.local.cpu
    return [bool(cpu.lookup([k[:-4]])) for k in keys]


def costs(engine: Engine, recompute_s: float, disk_s: float) -> None:
    """What the engine's steps say a block's recompute costs, and the disk's loads its
    read (many samples: the moving averages are there)."""
    cost = engine.manager.cost
    assert cost is not None
    for _ in range(60):
        cost.observe_step(TOKENS * 4, 4 * recompute_s)
        cost.observe_load("disk", 4, 4 * disk_s)


def scan(engine: Engine, keys: list[bytes], req_id: str) -> int:
    """vLLM's prefix lookup (the disk answers at once: one pass)."""
    ctx = ReqContext(req_id=req_id)
    hits = 0
    for key in keys:
        if engine.manager.lookup(key, ctx) is not LookupResult.HIT:
            break
        hits += 1
    return hits


def decided(engine: Engine, decision: str) -> float:
    values = (
        engine.manager.get_stats().data["data"].get(METRICS[f"decided_{decision}_blocks"].name, {})
    )
    return float(values.get(("disk",), 0))


def test_a_returning_prompt_is_loaded_from_disk_where_it_beats_recompute_and_not_where_not(
    engines: list[Engine], tmp_path: Path
) -> None:
    engine, keys = disk_engine(engines, tmp_path)
    assert in_cpu(engine, keys) == [True, True] + [False] * 4
    costs(engine, recompute_s=0.5, disk_s=0.001)  # a big model: the disk wins
    assert scan(engine, keys, "fast-disk") == 6
    assert decided(engine, "load") == 4  # the four blocks only the disk holds

    costs(engine, recompute_s=0.0001, disk_s=0.05)  # a tiny model, a disk gone slow
    # the head from the CPU tier; the tail only the slow disk holds is recomputed
    assert scan(engine, keys, "slow-disk") == 2
    assert decided(engine, "recompute") == 1  # the run's first block, where vLLM stops


def test_a_disk_run_behind_the_loads_in_flight_waits_for_them_and_may_not_pay(
    engines: list[Engine], tmp_path: Path
) -> None:
    """The disk's reads are shared: a run of disk blocks waits for the disk blocks of the
    loads already in flight. Alone, four blocks read at 10 ms beat recomputing them at
    30 ms; behind another request's four in flight they take 80 ms against 120: still
    worth it; behind eight (two such requests), 120 ms: no faster, recomputed (and a run
    recomputed adds nothing to the queue). The prompt's length (the connector's
    `note_prompt`) says how long the run is."""
    engine, keys = disk_engine(engines, tmp_path)
    costs(engine, recompute_s=0.03, disk_s=0.01)
    manager = engine.manager
    on_disk = keys[2:]

    def ask(req_id: str) -> int:
        ctx = ReqContext(req_id=req_id)
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * TOKENS)
        manager.note_prompt(req_id, len(keys) * TOKENS)
        hits = 0
        for key in keys:
            if manager.lookup(key, ctx) is not LookupResult.HIT:
                break
            hits += 1
        if hits == len(keys):  # its load is now in flight, as the scheduler's would be
            manager.prepare_load(on_disk, ctx)
        return hits

    assert [ask(f"r{i}") for i in range(4)] == [6, 6, 2, 2]
    assert decided(engine, "recompute") == 2  # each declined run's first block


@pytest.mark.parametrize("redis", [False, True], ids=["local", "over-redis"])
def test_a_disk_run_that_ends_before_the_prompt_is_judged_by_its_own_blocks(
    engines: list[Engine], tmp_path: Path, redis: bool
) -> None:
    """The prompt's keys (the connector's `PromptChain`) say where its local run ends:
    here six blocks of twelve, the last six new. What loading saves is the run's
    recompute (what follows it is recomputed either way): its four disk blocks behind
    eight in flight take 120 ms against 120 ms of recompute, no faster, so recomputed.
    Judged as if the run reached the prompt's end (as with its length alone), the same
    queue looked worth it: 180 ms against 300. Over a Redis tier, which may hold what
    follows the run (declined, it would be recomputed too), it is judged so still."""
    with ExitStack() as stack:
        extra = {}
        if redis:
            (tmp_path / "redis").mkdir()
            server = stack.enter_context(contextlib.closing(serve_redis(tmp_path / "redis")))
            extra = {"redis_url": next(server).url}
        engine, keys = disk_engine(engines, tmp_path, **extra)
        costs(engine, recompute_s=0.03, disk_s=0.01)
        manager = engine.manager
        new = keys_of(6, start=2000)
        prompt = keys + new
        hashes = [k[:-4] for k in prompt]

        def ask(req_id: str, chain: PromptChain | None) -> int:
            ctx = ReqContext(req_id=req_id)
            for i, key in enumerate(prompt):
                ctx.set_offload_key_position(key, (i + 1) * TOKENS)
            manager.note_prompt(req_id, len(prompt) * TOKENS, chain)
            hits = 0
            for key in prompt:
                if manager.lookup(key, ctx) is not LookupResult.HIT:
                    break
                hits += 1
            return hits

        assert manager.disk_runs is not None
        manager.disk_runs.loading = 8  # two other requests' runs of four, in flight
        assert ask("by-length", None) == 6  # the kind judgment of old
        assert ask("by-keys", PromptChain(hashes, 1, 0)) == (6 if redis else 2)
        assert decided(engine, "recompute") == (0 if redis else 1)
        manager.disk_runs.loading = 4  # one request's run in flight: 80 ms against 120
        assert ask("by-keys-again", PromptChain(hashes, 1, 0)) == 6


def test_a_disk_recomputed_around_is_measured_again_now_and_then(
    engines: list[Engine], tmp_path: Path
) -> None:
    engine, keys = disk_engine(engines, tmp_path)
    costs(engine, recompute_s=0.0001, disk_s=0.05)
    found = [scan(engine, keys, f"r{i}") for i in range(2 * PROBE_EVERY)]
    # one request in PROBE_EVERY loads anyway: its load refreshes the disk's estimate
    assert found.count(6) == 2 and set(found) == {2, 6}
    assert found.index(6) == PROBE_EVERY - 1


def test_a_stalled_disk_costs_its_loads_at_most_their_deadline(
    engines: list[Engine], tmp_path: Path
) -> None:
    """The disk stops answering in the middle of a load: at the deadline (about what
    recomputing the blocks costs) the worker reports them failed and vLLM recomputes
    them; a CPU-tier load queued behind it in the cascade's worker is given up at its own
    deadline; when the disk answers again, not one byte reaches the engine's blocks, and
    the disk still holds the blocks (nothing was wrong with them)."""
    engine, keys = disk_engine(engines, tmp_path, cpu_blocks=4)
    costs(engine, recompute_s=0.5, disk_s=0.001)
    manager, worker = engine.manager, engine.worker
    before = {i: engine.block_bytes(i) for i in range(12, 16)}
    disk = worker.disk
    assert disk is not None
    stalled, release = threading.Event(), threading.Event()

    def hang(kind: str) -> None:
        if kind == "read":
            stalled.set()
            release.wait()

    now = [1000.0]
    worker.clock = lambda: now[0]
    disk.io_hook = hang
    try:
        disk_ctx, cpu_ctx = ReqContext(req_id="from-disk"), ReqContext(req_id="from-cpu")
        on_disk = [k for k, cpu in zip(keys, in_cpu(engine, keys), strict=True) if not cpu]
        for key in keys:
            assert manager.lookup(key, disk_ctx) is LookupResult.HIT
        spec = manager.prepare_load(on_disk[:2], disk_ctx)
        assert spec.deadline_s == pytest.approx(1.0)  # two blocks' recompute
        worker.submit_load(1, spec, GPULoadStoreSpec([12, 13], [2], [0]))
        assert stalled.wait(timeout=60)  # the read hangs in the cascade's worker
        in_cpu_now = [k for k, cpu in zip(keys, in_cpu(engine, keys), strict=True) if cpu]
        cpu_keys = [k for k in in_cpu_now if k not in on_disk[:2]][:2]  # not promoted ones
        cpu_spec = manager.prepare_load(cpu_keys, cpu_ctx)
        assert cpu_spec.deadline_s == pytest.approx(1.0)
        worker.submit_load(2, cpu_spec, GPULoadStoreSpec([14, 15], [2], [0]))
        assert worker.get_finished() == []  # both in flight, before their deadlines
        now[0] += 1.1
        results = sorted((r.job_id, r.success) for r in worker.get_finished())
        assert results == [(1, True), (2, True)]  # done, as failed loads
        assert worker.take_load_errors() == {12, 13, 14, 15}  # vLLM recomputes them
        report = worker.take_report()
        assert report.expired_loads == {"disk": 2, "cpu": 2}
        # what the disk read took at least (its deadline) teaches the
        # disk's estimate; the CPU load queued behind it is no sample of the CPU tier
        ((tier, blocks, took),) = report.loads
        assert (tier, blocks) == ("disk", 2) and 0.5 < took <= 1.0 + 1e-9
        manager.apply_worker_report(report)
        manager.complete_load(set(on_disk[:2]), disk_ctx)
        manager.complete_load(set(cpu_keys), cpu_ctx)
    finally:
        release.set()
    worker.workers["local"].close()  # the late read has come and gone
    assert {i: engine.block_bytes(i) for i in range(12, 16)} == before
    stats = manager.get_stats().data["data"]
    assert stats[METRICS["load_expired_blocks"].name] == {("disk",): 2, ("cpu",): 2}
    assert scan(engine, keys, "after") == 6  # kept: the disk holds them still
    # vLLM reschedules a request whose load failed and asks again: its blocks then miss
    # (offered again, a hung disk would fail the same load for ever)
    assert manager.lookup(on_disk[0], disk_ctx) is LookupResult.MISS
    assert manager.lookup(cpu_keys[0], cpu_ctx) is LookupResult.MISS
