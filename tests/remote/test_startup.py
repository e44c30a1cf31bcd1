"""Start-up: one behaviour for a single node and a cluster node list (issue 15 items 6, 7).

A server that answers and refuses the configuration (wrong password, a database it does
not have, a node that is not in cluster mode) fails at start, naming the URL part; a
server nobody can reach degrades the tier (counted errors, the breaker), whether it is
one node or a node list, as the README promises for a Redis that is down.
"""

from __future__ import annotations

import pytest

from kvtier.net import free_port
from kvtier.remote.redis_store import RedisBlockStore, RemoteStartupError
from kvtier.remote.remote_config import RemoteConfig
from kvtier.types import int_block_hash
from tests.remote.conftest import RedisServer

FP = "model=tiny|dtype=fp16|block=16|format=1"
HASHES = [int_block_hash(i) for i in range(4)]


def test_a_database_the_server_lacks_fails_at_start(redis_server: RedisServer) -> None:
    url = redis_server.url.replace("/0", "/99")
    with pytest.raises(RemoteStartupError, match=r"has no database 99 \(the URL path"):
        RedisBlockStore.connect(RemoteConfig(url=url), FP)


def test_a_node_list_of_plain_servers_fails_at_start(redis_server: RedisServer) -> None:
    url = f"redis://127.0.0.1:{redis_server.port},127.0.0.1:{redis_server.port}"
    with pytest.raises(RemoteStartupError, match="names a node that is not in cluster mode"):
        RedisBlockStore.connect(RemoteConfig(url=url), FP)


@pytest.mark.parametrize("cluster", [False, True])
def test_unreachable_degrades_alike_for_one_node_and_a_node_list(
    cluster: bool, caplog: pytest.LogCaptureFixture
) -> None:
    ports = free_port(), free_port()
    url = (
        f"redis://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
        if cluster
        else f"redis://127.0.0.1:{ports[0]}/0"
    )
    store = RedisBlockStore.connect(RemoteConfig(url=url), FP)
    assert "unreachable at start-up" in caplog.text
    assert store.count_prefix(HASHES) == 0  # a miss, not an exception
    assert not store.store(HASHES, [b"x" * 8] * 4)
    assert store.stats.errors >= 1
    store.close()
