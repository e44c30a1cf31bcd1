"""KvtierOffloadingSpec under tensor parallelism and with several KV-cache groups, in
process (`tests.vllm.parallel_engine`), with blocks kept by rank: the Redis tier's
layout when vLLM's KV cache is not head-major (see `test_head_sharing` for the other).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.remote.conftest import serve_redis
from tests.vllm.needs_vllm import quiet
from tests.vllm.parallel_engine import (
    BLOCK_BYTES,
    ParallelEngine,
    config,
    keys_of,
)

with quiet():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.remote.codec import BlockCodec
    from kvtier.vllm.offloading.engine_shape import layout_for, shard_root
    from kvtier.vllm.offloading.job_specs import WorkerReport
    from kvtier.vllm.offloading.kvtier_connector import check_layer_types, worker_meta
    from kvtier.vllm.offloading.offloading_spec import UNDER_KVTIER_CONNECTOR, KvtierOffloadingSpec


def test_each_worker_moves_its_own_shard(engines: list[ParallelEngine], tmp_path: Path) -> None:
    extra = {
        "cpu_bytes_to_use": 2 * BLOCK_BYTES,  # two blocks: the rest are demoted to disk
        "disk_path": str(tmp_path),
        "disk_bytes_to_use": 1 << 20,
        "disk_fsync": False,
    }
    engine = ParallelEngine(extra)
    engines.append(engine)
    keys = keys_of(4)
    data = engine.compute([0, 1, 2, 3], seed=1)
    assert data[0][0] != data[1][0]
    for key, device_id in zip(keys, range(4), strict=True):
        assert not engine.store([key], [device_id])
    engine.compute([0, 1, 2, 3], seed=2)  # the device blocks are reused
    assert engine.hits(keys) == [True] * 4
    errors, report = engine.load(keys, [8, 9, 10, 11])  # from disk (two) and CPU (two)
    assert not errors and not report
    for rank in (0, 1):
        assert [engine.shard(rank, i) for i in (8, 9, 10, 11)] == list(data[rank].values())
    for rank in (0, 1):  # each rank's shards in a directory of its own
        assert len(list((tmp_path / f"rank{rank}-of-2").glob("kvtier-*/*.kv"))) >= 2


def _files(tmp_path: Path, rank: int, key: bytes) -> list[Path]:
    return list((tmp_path / f"rank{rank}-of-2").glob(f"kvtier-*/{key[:-4].hex()}*"))


def test_a_block_counts_only_when_every_rank_has_its_shard(
    engines: list[ParallelEngine], tmp_path: Path
) -> None:
    extra = {
        "cpu_bytes_to_use": 8 * BLOCK_BYTES,
        "disk_path": str(tmp_path),
        "disk_bytes_to_use": 1 << 20,
        "disk_writes": "write_through",
    }
    first = ParallelEngine(extra)
    keys = keys_of(4)
    data = first.compute([0, 1, 2, 3], seed=3)
    first.store(keys, [0, 1, 2, 3])
    first.close()
    # rank 1's shard of block 0 is lost while the engine is down
    (lost,) = _files(tmp_path, 1, keys[0])
    lost.unlink()

    second = ParallelEngine(extra)  # restarts on the same directories
    engines.append(second)
    assert second.hits(keys) == [False, True, True, True]  # block 0 is in no tier
    assert _files(tmp_path, 0, keys[0])  # rank 0's orphan goes with the next job
    second.store(keys_of(6)[4:], [4, 5])
    assert not _files(tmp_path, 0, keys[0])

    # a corrupt shard on rank 1 only: the load fails on every rank, vLLM recomputes
    (victim,) = _files(tmp_path, 1, keys[1])
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    errors, report = second.load(keys[1:], [8, 9, 10])
    assert errors == {8, 9, 10}  # rank 1's failed part: vLLM recomputes them on all ranks
    assert report.corrupt_blocks == [keys[1][:-4]]
    assert second.hits(keys[1:]) == [False] * 3  # that request recomputes them all
    second.ctx = ReqContext(req_id="another request")
    assert second.hits(keys[1:]) == [False, True, True]  # forgotten on every rank
    errors, report = second.load(keys[2:], [9, 10])  # the intact blocks still serve
    assert not errors and not report
    for rank in (0, 1):
        assert [second.shard(rank, i) for i in (9, 10)] == [data[rank][2], data[rank][3]]
    second.store(keys_of(7)[6:], [6])
    assert not _files(tmp_path, 0, keys[1])  # rank 0's intact shard is deleted too


def test_redis_offers_a_block_only_when_every_rank_holds_its_shard(
    engines: list[ParallelEngine], tmp_path: Path
) -> None:
    servers = serve_redis(tmp_path)
    server = next(servers)
    try:
        extra = {"cpu_bytes_to_use": 2 * BLOCK_BYTES, "redis_url": server.url}
        writer = ParallelEngine(extra)
        engines.append(writer)
        keys = keys_of(3)
        data = writer.compute([0, 1, 2], seed=8)
        writer.store(keys, [0, 1, 2])
        # Redis loses rank 1's shard of block 1 (evicted, or its store timed out)
        rank1 = layout_for(config(extra, tp=2, rank=1)).fingerprint
        namespace = BlockCodec.for_fingerprint(rank1).fp_digest[:8].hex().encode()
        client = server.client()
        (lost,) = [
            k for k in client.keys("*") if namespace in k and keys[1][:-4].hex().encode() in k
        ]
        client.delete(lost)
        client.close()

        reader = ParallelEngine(extra | {"cpu_bytes_to_use": 8 * BLOCK_BYTES})
        engines.append(reader)
        reader.hits(keys)  # asks every rank's keys, asynchronously
        assert reader.manager.remote.wait_lookups(timeout=30)
        assert reader.hits(keys) == [True, False, True]  # block 1 is in no tier
        errors, report = reader.load(keys[:1], [8])
        assert not errors and not report
        assert [reader.shard(rank, 8) for rank in (0, 1)] == [data[0][0], data[1][0]]
    finally:
        next(servers, None)


def test_a_lookup_that_timed_out_is_asked_again_not_cut_short(
    engines: list[ParallelEngine], tmp_path: Path
) -> None:
    """What cut a tensor-parallel engine's return from Redis short on a loaded machine
    (32 or 128 of 192 tokens): the ranks' lookups of one block timed out, that block was
    answered as a miss, and vLLM loaded the blocks before it. Not known is not a miss."""
    servers = serve_redis(tmp_path)
    server = next(servers)
    try:
        extra = {"cpu_bytes_to_use": 2 * BLOCK_BYTES, "redis_url": server.url}
        writer = ParallelEngine(extra)
        engines.append(writer)
        keys = keys_of(2)
        writer.compute([0, 1], seed=4)
        assert not writer.store(keys, [0, 1])

        reader = ParallelEngine(extra)
        engines.append(reader)
        assert reader.hits(keys[:1]) == [False]  # asked every rank's shard
        assert reader.manager.remote.wait_lookups(timeout=30)
        server.pause()  # the next round trips time out (0.25 s)
        try:
            assert reader.hits(keys) == [True, False]
            assert reader.manager.remote.wait_lookups(timeout=30)
        finally:
            server.resume()
        assert reader.manager.remote.store.stats.errors == 1  # (rank 0's store's count)
        asked = [reader.manager.lookup(k, reader.ctx) for k in keys]
        assert asked == [LookupResult.HIT, LookupResult.RETRY]  # block 1 was a MISS
        assert reader.manager.remote.wait_lookups(timeout=30)
        assert reader.hits(keys) == [True, True]
    finally:
        next(servers, None)


def test_a_step_that_schedules_nothing_waits_for_the_lookups_out(
    engines: list[ParallelEngine], tmp_path: Path
) -> None:
    """The engine's empty steps while Redis lookups are out (each runs every worker) left
    a tensor-parallel engine's lookups too little CPU; such a step now waits for them."""
    from types import SimpleNamespace

    from kvtier.vllm.offloading.kvtier_connector import wait_for_lookups

    servers = serve_redis(tmp_path)
    server = next(servers)
    try:
        # a timeout that never ends the pause: the lookups stay out until it does
        extra = {"redis_url": server.url, "redis_socket_timeout_s": 60.0}
        engine = ParallelEngine({"cpu_bytes_to_use": 2 * BLOCK_BYTES} | extra)
        engines.append(engine)
        keys = keys_of(3)
        server.pause()
        try:
            assert engine.hits(keys) == [False] * 3
            busy, idle = (SimpleNamespace(total_num_scheduled_tokens=n) for n in (7, 0))
            assert not wait_for_lookups(engine.manager, busy)  # a step with work: no wait
            assert not engine.manager.wait_lookups(0.0)
            assert wait_for_lookups(engine.manager, idle)  # waited (and they are still out)
        finally:
            server.resume()
        assert engine.manager.wait_lookups(30)
        assert wait_for_lookups(engine.manager, idle)  # nothing out: returns at once
    finally:
        next(servers, None)


def test_a_rank_whose_redis_tier_fails_to_open_closes_those_opened(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kvtier.remote.redis_store import RemoteStartupError
    from kvtier.remote.tier import RemoteTier

    opened: list[RemoteTier] = []
    closed: list[RemoteTier] = []
    from_url = RemoteTier.from_url

    def open_rank(*args: Any, **kwargs: Any) -> RemoteTier:
        if opened:
            raise RemoteStartupError("rank 1 refused")
        tier = from_url(*args, **kwargs)
        monkeypatch.setattr(tier, "close", lambda: closed.append(tier))
        opened.append(tier)
        return tier

    servers = serve_redis(tmp_path)
    server = next(servers)
    try:
        monkeypatch.setattr(RemoteTier, "from_url", open_rank)
        extra = {"cpu_bytes_to_use": 2 * BLOCK_BYTES, "redis_url": server.url}
        token = UNDER_KVTIER_CONNECTOR.set(True)
        try:
            spec = KvtierOffloadingSpec(config(extra, tp=2))
        finally:
            UNDER_KVTIER_CONNECTOR.reset(token)
        with pytest.raises(RemoteStartupError, match="rank 1 refused"):
            spec.get_manager()
        assert len(opened) == 1 and closed == opened  # rank 0's connection not leaked
        for tier in opened:
            RemoteTier.close(tier)  # the real close
    finally:
        next(servers, None)


def test_shards_are_named_by_rank_parallel_layout_and_groups(tmp_path: Path) -> None:
    one = layout_for(config({}))
    rank0, rank1 = (layout_for(config({}, tp=2, rank=r)) for r in (0, 1))
    hybrid = layout_for(config({}, groups=2))
    fingerprints = {x.fingerprint for x in (one, rank0, rank1, hybrid)}
    assert len(fingerprints) == 4  # no two of them ever read each other's blocks
    again = layout_for(config({}, tp=2, rank=1, engine_id="another-engine"))
    assert again.fingerprint == rank1.fingerprint  # another engine of that layout shares
    assert shard_root(str(tmp_path), config({})) == tmp_path
    assert shard_root(str(tmp_path), config({}, tp=2, rank=1)) == tmp_path / "rank1-of-2"


def test_every_kv_cache_group_has_blocks_of_its_own(engines: list[ParallelEngine]) -> None:
    engine = ParallelEngine({"cpu_bytes_to_use": 8 * BLOCK_BYTES}, tp=1, groups=2)
    engines.append(engine)
    full, window = keys_of(3, group=0), keys_of(3, group=1)  # the same hashes
    data = engine.compute([0, 1, 2, 3, 4, 5], seed=5)[0]
    keys = full + window[1:]  # a sliding-window group: only the window's blocks
    assert not engine.store(keys, [0, 1, 2, 4, 5])
    assert engine.hits(window) == [False, True, True]
    engine.compute([0, 1, 2, 3, 4, 5], seed=6)
    errors, report = engine.load(full + window[1:], [8, 9, 10, 11, 12])
    assert not errors and not report
    assert [engine.shard(0, i) for i in (8, 9, 10, 11, 12)] == [data[i] for i in (0, 1, 2, 4, 5)]


def test_every_rank_report_reaches_the_scheduler() -> None:
    """vLLM sums the workers' metadata with the first one's `aggregate`."""
    corrupt = WorkerReport(corrupt_blocks=[b"h" * 32])
    rank0 = worker_meta(OffloadingWorkerMetadata({3: 1}), WorkerReport())
    rank1 = worker_meta(OffloadingWorkerMetadata({3: 1}), corrupt)
    merged = rank0.aggregate(rank1)
    assert merged.completed_jobs == {3: 2}
    assert merged.report.corrupt_blocks == corrupt.corrupt_blocks


def test_pipeline_parallelism_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"pipeline parallelism .* stages hold different"):
        KvtierOffloadingSpec(config({"cpu_bytes_to_use": 1 << 20}, pp=2))


def test_mamba_layers_are_refused_by_name() -> None:
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import MambaSpec

    spec = object.__new__(MambaSpec)  # only its type is looked at
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.mixer"])
    with pytest.raises(ValueError, match=r"MambaSpec layers .*model\.layers\.0\.mixer"):
        check_layer_types(SimpleNamespace(kv_cache_groups=[group]))


class _SlowAnswers:
    """An asynchronous lookup as kvtier's Redis tier does it: the first question starts
    it (None), the answer is handed out once, `calls` questions later; then it restarts."""

    def __init__(self, answer: int, calls: int) -> None:
        self.answer, self.calls, self.asked = answer, calls, 0

    def lookup(self, block_hashes: Any) -> int | None:
        self.asked += 1
        if self.asked <= self.calls:
            return None
        self.asked = 0
        return self.answer


def test_every_shard_lookup_keeps_answers_until_all_are_in() -> None:
    """Workers whose answers come in on different steps: asking all of them again each
    time would alternate forever (each answer is handed out once)."""
    from kvtier.vllm.offloading.shard_lookup import EveryShardLookup

    lookup = EveryShardLookup(_SlowAnswers(3, 1), [_SlowAnswers(2, 2)])  # type: ignore[list-item,arg-type]
    answers = [lookup.lookup([b"k" * 32]) for _ in range(3)]
    assert answers == [None, None, 2]  # the shorter prefix, once both are in


class _Trips:
    """A worker's lookups as `lookup_in_flight` tells of them (None: between trips)."""

    def __init__(self, trip: tuple[int, float] | None) -> None:
        self.trip = trip

    def lookup_in_flight(self) -> tuple[int, float] | None:
        return self.trip


def test_every_shard_lookup_is_behind_the_oldest_round_trip_on_its_way() -> None:
    """A request waits for every worker's answer: the oldest trip ahead of it bounds its
    wait from below (`RemoteRuns._behind_s`); trips are numbered apart per worker."""
    from kvtier.vllm.offloading.shard_lookup import EveryShardLookup

    first, second = _Trips(None), _Trips(None)
    lookup = EveryShardLookup(first, [second])  # type: ignore[arg-type,list-item]
    assert lookup.lookup_in_flight() is None
    first.trip, second.trip = (7, 0.1), (7, 0.4)
    assert lookup.lookup_in_flight() == (7 * 2 + 1, 0.4)  # the second worker's, older
    second.trip = (8, 0.01)  # its trip ended and another began: the first is now oldest
    assert lookup.lookup_in_flight() == (7 * 2 + 0, 0.1)
