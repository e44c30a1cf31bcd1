"""The store on a real three-node Redis Cluster, configured by a node list."""

from __future__ import annotations

from kvtier.remote.breaker import BreakerConfig, BreakerState
from kvtier.remote.tier import RemoteTier
from kvtier.types import int_block_hash
from tests.remote.conftest import FakeClock, RedisServer

FP = "model=tiny|dtype=fp16|block=16|format=1"
HASHES = [int_block_hash(i) for i in range(60)]
PAYLOADS = [i.to_bytes(2, "big") * 700 for i in range(60)]


def node_list_url(nodes: list[RedisServer]) -> str:
    return "redis://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes[:2])


def test_blocks_spread_over_nodes_and_prefix_lookup_spans_them(
    redis_cluster: list[RedisServer],
) -> None:
    with RemoteTier.from_url(node_list_url(redis_cluster), FP, block_size=16) as tier:
        store = tier.store
        assert store.config.is_cluster
        assert store.store(HASHES, PAYLOADS, salt="t1")
        assert store.count_prefix(HASHES, salt="t1") == 60
        assert [bytes(v) for v in store.load(HASHES, salt="t1") if v is not None] == PAYLOADS
        assert store.count_prefix(HASHES, salt="t2") == 0
        per_node = [n.client().dbsize() for n in redis_cluster]
        assert sum(per_node) == 60 and min(per_node) > 0  # the hash tag spreads blocks
        client = redis_cluster[0].client()
        key = store.key(HASHES[7], salt="t1")
        tag = HASHES[7].hex().encode()
        assert client.cluster("KEYSLOT", key) == client.cluster("KEYSLOT", tag)
        client.close()
        store.client.delete(store.key(HASHES[30], salt="t1"))  # a hole, on its node
        assert store.count_prefix(HASHES, salt="t1") == 30
        pieces = [[p[:600], p[600:]] for p in PAYLOADS[:5]]  # built whole in its buffers
        assert store.store_pieces(HASHES[:5], pieces, salt="t3")
        assert [bytes(v) for v in store.load(HASHES[:5], salt="t3") if v] == PAYLOADS[:5]


def test_a_dead_node_costs_misses_not_exceptions(redis_cluster: list[RedisServer]) -> None:
    clock = FakeClock()
    tier = RemoteTier.from_url(
        node_list_url(redis_cluster),
        FP,
        block_size=16,
        clock=clock,
        breaker=BreakerConfig(failure_threshold=2, reset_timeout_s=5.0),
    )
    store = tier.store
    assert store.store(HASHES, PAYLOADS)
    redis_cluster[2].kill()  # a third of the slots are gone
    for _ in range(2):
        # a pipeline touching the dead node fails as a whole: a miss, then the breaker
        assert store.count_prefix(HASHES) == 0
    assert store.breaker.state is BreakerState.OPEN and store.stats.errors == 2
    assert not store.store(HASHES[:5], PAYLOADS[:5])
    assert store.load(HASHES[:3]) == [None, None, None]
    assert store.stats.skipped_calls == 2
    tier.close()
