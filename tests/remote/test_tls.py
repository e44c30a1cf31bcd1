"""rediss:// against a real TLS redis-server with a throwaway CA."""

from __future__ import annotations

import pytest

from kvtier.remote.redis_store import RemoteStartupError
from kvtier.remote.tier import RemoteTier
from kvtier.types import int_block_hash
from tests.remote.conftest import RedisServer

FP = "model=tiny|dtype=fp16|block=16|format=1"
HASHES = [int_block_hash(i) for i in range(4)]


def test_round_trip_over_tls(redis_server_tls: RedisServer) -> None:
    assert redis_server_tls.tls is not None
    url = redis_server_tls.url
    assert url.startswith("rediss://")
    ca = str(redis_server_tls.tls.ca)
    with RemoteTier.from_url(url, FP, block_size=16, ssl_ca_certs=ca) as tier:
        payloads = [bytes([i]) * 300_000 for i in range(4)]  # several TLS records each
        assert tier.store.store(HASHES, payloads)
        assert tier.store.count_prefix(HASHES) == 4
        assert [bytes(v) for v in tier.store.load(HASHES) if v is not None] == payloads


def test_untrusted_certificate_is_a_clear_start_up_error(redis_server_tls: RedisServer) -> None:
    with pytest.raises(RemoteStartupError, match=r"TLS handshake.*ssl_ca_certs"):
        RemoteTier.from_url(redis_server_tls.url, FP, block_size=16)  # system CAs only
