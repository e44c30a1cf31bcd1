"""The shaping proxy (kvtier.remote.shaping_proxy) in front of a real redis-server: it
passes every byte, adds its delay to every round trip, caps the rate, and stalls on
demand. Times are checked as lower bounds only (what the proxy guarantees), never as
upper bounds (what a busy machine may not give)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from kvtier.remote.proxy_process import ProxyProcess
from kvtier.remote.shaping_proxy import LinkProfile, ShapingProxy
from tests.remote.conftest import RedisServer


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[ShapingProxy]:
    with ShapingProxy(("127.0.0.1", redis_server.port)) as shaping:
        yield shaping


def client(proxy: ShapingProxy | ProxyProcess, timeout_s: float = 30.0) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=timeout_s)


def pass_two_mib_both_ways(proxy: ShapingProxy | ProxyProcess) -> None:
    """SET then GET 2 MiB (several chunks each way) through `proxy`: the same bytes back,
    and each byte counted as forwarded both ways."""
    value = bytes(range(256)) * 8192
    r = client(proxy)
    r.set("k", value)
    assert r.get("k") == value
    assert proxy.bytes_forwarded >= 2 * len(value)


def test_every_byte_passes_both_ways(proxy: ShapingProxy) -> None:
    pass_two_mib_both_ways(proxy)
    assert proxy.connections == 1


def test_the_cpu_its_threads_spend_is_counted(proxy: ShapingProxy) -> None:
    """What a benchmark reports beside its figures (the proxy shares the engines' cores)."""
    assert proxy.cpu_seconds == 0.0
    r = client(proxy)
    r.set("k", bytes(4 << 20))
    first = proxy.cpu_seconds
    assert first > 0.0
    assert r.get("k") == bytes(4 << 20)
    assert proxy.cpu_seconds >= first  # CPU time only grows


def test_a_round_trip_takes_at_least_both_delays(proxy: ShapingProxy) -> None:
    r = client(proxy)
    r.ping()  # connected before the link slows
    proxy.reshape(LinkProfile.round_trip(0.2))
    started = time.monotonic()
    assert r.ping()
    assert time.monotonic() - started >= 0.2
    proxy.reshape(LinkProfile())
    assert r.ping()


def test_the_rate_cap_bounds_a_large_value(proxy: ShapingProxy) -> None:
    r = client(proxy)
    r.ping()
    proxy.reshape(LinkProfile(rate_bytes_per_s=4 << 20))
    started = time.monotonic()
    r.set("big", b"x" * (1 << 20))  # 1 MiB up at 4 MiB/s: at least a quarter second
    assert time.monotonic() - started >= 0.25


def test_a_stall_holds_every_answer_until_resumed(proxy: ShapingProxy) -> None:
    r = client(proxy, timeout_s=0.3)
    r.set("k", b"v")
    proxy.stall()
    assert proxy.stalled
    with pytest.raises(redis.TimeoutError):
        r.get("k")
    proxy.resume()
    fresh = client(proxy)  # the timed-out connection may hold a late reply
    assert fresh.get("k") == b"v"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"up_delay_s": -1}, "up_delay_s=-1; a finite number of seconds >= 0"),
        ({"down_delay_s": "slow"}, "down_delay_s='slow'; a number of seconds >= 0"),
        ({"rate_bytes_per_s": 0}, "rate_bytes_per_s=0; a number of bytes per second > 0"),
        ({"max_buffered_bytes": 10}, "max_buffered_bytes=10; at least"),
    ],
)
def test_bad_profiles_name_the_field_and_what_is_allowed(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LinkProfile(**fields)  # type: ignore[arg-type]
