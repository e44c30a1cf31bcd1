"""The shaping proxy in a child process (kvtier.remote.proxy_process), in front of a real
redis-server: the same link as in-process, its controls over a pipe, its niceness its
own. Times are lower bounds only."""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator

import pytest
import redis

from kvtier.remote.proxy_process import ProxyProcess, serve
from kvtier.remote.shaping_proxy import LinkProfile, ShapingProxy
from tests.remote.conftest import RedisServer
from tests.remote.test_shaping_proxy import client, pass_two_mib_both_ways


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[ProxyProcess]:
    with ProxyProcess(("127.0.0.1", redis_server.port), nice=19) as shaping:
        yield shaping


def test_bytes_pass_and_the_child_counts_them_and_its_cpu(proxy: ProxyProcess) -> None:
    pass_two_mib_both_ways(proxy)
    assert proxy.cpu_seconds > 0.0


def test_the_child_runs_at_the_niceness_asked(proxy: ProxyProcess) -> None:
    assert os.getpriority(os.PRIO_PROCESS, proxy.pid) == 19


def test_reshape_and_stall_reach_the_child(proxy: ProxyProcess) -> None:
    r = client(proxy, timeout_s=0.3)
    r.set("k", b"v")
    proxy.reshape(LinkProfile.round_trip(0.2))
    started = time.monotonic()
    assert r.ping()
    assert time.monotonic() - started >= 0.2
    proxy.reshape(LinkProfile())
    proxy.stall()  # in effect when the call returns
    with pytest.raises(redis.TimeoutError):
        r.get("k")
    proxy.resume()
    assert client(proxy).get("k") == b"v"


def test_closing_ends_the_child(redis_server: RedisServer) -> None:
    proxy = ProxyProcess(("127.0.0.1", redis_server.port))
    assert os.getpriority(os.PRIO_PROCESS, proxy.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    proxy.close()
    assert proxy._proc.returncode is not None
    with pytest.raises(RuntimeError, match="the proxy process exited"):
        proxy.stall()


def test_a_bad_command_gets_an_error_naming_it(redis_server: RedisServer) -> None:
    commands = io.StringIO('{"op": "faster"}\n{"op": "reshape", "profile": {"up_delay_s": -1}}\n')
    replies = io.StringIO()
    with ShapingProxy(("127.0.0.1", redis_server.port)) as proxy:
        serve(proxy, commands, replies)
    errors = [json.loads(line)["error"] for line in replies.getvalue().splitlines()]
    assert "op 'faster'; one of reshape, stall, resume, stats" in errors[0]
    assert "up_delay_s=-1" in errors[1]


@pytest.mark.parametrize("nice", [-1, 20, 1.5, True])
def test_a_bad_niceness_names_the_value_and_what_is_allowed(nice: object) -> None:
    with pytest.raises(ValueError, match=r"nice=.*; an integer from 0 \(the default"):
        ProxyProcess(("127.0.0.1", 1), nice=nice)  # type: ignore[arg-type]
