"""Real KV bytes through the transfer worker into Redis and back, and its failures."""

from __future__ import annotations

import pytest
import torch

from kvtier.remote.breaker import BreakerConfig
from kvtier.remote.remote_manager import RemoteLoadStoreSpec
from kvtier.remote.tier import RemoteTier
from kvtier.store.layout import KVLayout, LayoutMismatchError
from kvtier.transfer.device import DeviceKV, allocate_kv_caches
from kvtier.transfer.transfer_worker import TransferWorker
from kvtier.types import int_block_hash
from tests.remote.conftest import FakeClock, RedisServer

PER_LAYER = KVLayout(num_layers=3, num_kv_heads=2, head_size=8, block_size=4, model_id="tiny")
CROSS_LAYER = KVLayout(
    num_layers=3, num_kv_heads=2, head_size=8, block_size=4, model_id="tiny", per_layer=False
)
HASHES = [int_block_hash(100 + i) for i in range(8)]
DEVICE_IDS = [5, 2, 3, 4, 11, 0, 9, 8]  # scattered and consecutive runs


def random_kv(layout: KVLayout, seed: int) -> DeviceKV:
    generator = torch.Generator().manual_seed(seed)
    caches = allocate_kv_caches(layout, num_blocks=12)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    return DeviceKV(layout, caches)


def block_bytes(kv: DeviceKV, block_id: int) -> bytes:
    return b"".join(seg[block_id].numpy().tobytes() for seg in kv.segments)


def run(worker: TransferWorker, job_id: int) -> bool:
    assert worker.wait([job_id], timeout=30)
    (result,) = worker.get_finished()
    assert result.job_id == job_id
    return result.ok


@pytest.mark.parametrize("layout", [PER_LAYER, CROSS_LAYER], ids=["per_layer", "cross_layer"])
def test_engine_a_stores_engine_b_loads_byte_identical(
    redis_server: RedisServer, layout: KVLayout
) -> None:
    source, target = random_kv(layout, seed=1), random_kv(layout, seed=2)
    expected = [block_bytes(source, i) for i in DEVICE_IDS]
    with RemoteTier.from_url(redis_server.url, layout, block_size=4) as tier_a:
        manager = tier_a.manager()
        out = manager.prepare_store(HASHES)
        assert out is not None
        with TransferWorker.for_store(source, tier_a.kv_store(layout)) as worker:
            worker.submit_store(1, DEVICE_IDS, out.store_spec)
            ok = run(worker, 1)
        manager.complete_store(HASHES, success=ok)
        assert ok
    with RemoteTier.from_url(redis_server.url, layout, block_size=4) as tier_b:
        manager = tier_b.manager()
        hit = manager.lookup(HASHES)
        assert hit == 8
        spec = manager.prepare_load(HASHES)
        targets = [0, 1, 2, 3, 7, 6, 5, 4]
        with TransferWorker.for_store(target, tier_b.kv_store(layout)) as worker:
            worker.submit_load(2, spec, targets)
            assert run(worker, 2)
        manager.complete_load(HASHES)
        assert [block_bytes(target, i) for i in targets] == expected
        assert tier_b.stats.loaded_bytes == 8 * layout.bytes_per_block


def test_missing_or_corrupt_block_fails_the_load_job(redis_server: RedisServer) -> None:
    kv = random_kv(CROSS_LAYER, seed=3)
    with RemoteTier.from_url(redis_server.url, CROSS_LAYER, block_size=4) as tier:
        store = tier.kv_store(CROSS_LAYER)
        spec = RemoteLoadStoreSpec(HASHES[:4])
        with TransferWorker.for_store(kv, store) as worker:
            worker.submit_store(1, [0, 1, 2, 3], spec)
            assert run(worker, 1)
            client = redis_server.client()
            client.setrange(tier.store.key(HASHES[2]), 100, b"\x00\xff")
            worker.submit_load(2, spec, [4, 5, 6, 7])
            assert not run(worker, 2)  # a failed job, not an exception
            assert "not servable" in worker.errors[-1][1]
            client.delete(tier.store.key(HASHES[0]))
            worker.submit_load(3, RemoteLoadStoreSpec(HASHES[:1]), [8])
            assert not run(worker, 3)
            client.close()
        assert tier.stats.corrupt_blocks == 1 and tier.stats.missing_blocks == 1


def test_dead_server_fails_store_jobs_and_the_scheduler_drops_them(
    redis_server: RedisServer,
) -> None:
    kv = random_kv(PER_LAYER, seed=4)
    clock = FakeClock()
    with RemoteTier.from_url(
        redis_server.url,
        PER_LAYER,
        block_size=4,
        clock=clock,
        breaker=BreakerConfig(failure_threshold=1, reset_timeout_s=5.0),
    ) as tier:
        manager = tier.manager()
        out = manager.prepare_store(HASHES[:2])
        assert out is not None
        redis_server.kill()
        with TransferWorker.for_store(kv, tier.kv_store(PER_LAYER)) as worker:
            worker.submit_store(1, [0, 1], out.store_spec)
            ok = run(worker, 1)
        manager.complete_store(HASHES[:2], success=ok)
        assert not ok and manager.num_in_flight == (0, 0)
        assert manager.lookup(HASHES) == 0


def test_layout_mismatch_is_refused(redis_server: RedisServer) -> None:
    with RemoteTier.from_url(redis_server.url, PER_LAYER, block_size=4) as tier:
        with pytest.raises(LayoutMismatchError, match="another layout fingerprint"):
            tier.kv_store(CROSS_LAYER)
        with pytest.raises(TypeError, match="RemoteLoadStoreSpec"):
            tier.kv_store(PER_LAYER).read_blocks(object(), [])  # type: ignore[arg-type]
