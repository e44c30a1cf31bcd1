"""`kvtier route`: its flags, its errors, and the command serving in its own process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from kvtier.cli import main
from kvtier.cli.route import parse_engine, parse_weights
from kvtier.net import free_port
from kvtier.router.scoring import Weights
from tests.router.fakes import FakeEngine, until_answered

REPO = Path(__file__).resolve().parents[2]


def test_engines_and_weights_parse() -> None:
    spec = parse_engine("http://h:1,tcp://h:2,tcp://h:3", "kv", False)
    assert (spec.url, spec.events, spec.replay, spec.topic) == (
        "http://h:1", "tcp://h:2", "tcp://h:3", "kv",
    )  # fmt: skip
    assert parse_engine("http://h:1", "", True).events is None
    assert parse_weights("cpu=0.5, load=0") == Weights(cpu=0.5, load=0.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "h:1"], "http://"),
        (["--engine", "http://h:1,a,b,c"], "URL[,EVENTS[,REPLAY]]"),
        (["--engine", "http://h:1", "--weights", "gpu"], "NAME=X"),
        (["--engine", "http://h:1", "--weights", "gpu=x"], "not a number"),
        (["--engine", "http://h:1", "--block-size", "0"], "block_size"),
        (["--engine", "http://h:1", "--routed-ttl", "-1"], "routed_ttl_s"),
        (["--engine", "http://h:1", "--routed-ttl", "inf"], "routed_ttl_s"),
    ],
)
def test_bad_flags_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["route", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_command_routes_until_stopped(stop: signal.Signals, code: int) -> None:
    async def scenario() -> None:
        engine = FakeEngine("e0")
        await engine.start()
        port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "route", "--engine", engine.url,
             "--port", str(port)],
            env=env, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            async with aiohttp.ClientSession() as session:
                base = f"http://127.0.0.1:{port}"

                async def answers() -> bool:
                    try:
                        async with session.get(base + "/health") as r:
                            return r.status == 200
                    except aiohttp.ClientError:
                        return False

                await until_answered(answers, "the router", timeout_s=60)
                payload = {"prompt": [1, 2, 3]}
                async with session.post(base + "/v1/completions", json=payload) as r:
                    assert r.status == 200 and (await r.json())["engine"] == "e0"
                    assert r.headers["X-Kvtier-Engine"] == engine.url.split("://")[1]
        finally:
            proc.send_signal(stop)
            _, err = proc.communicate(timeout=30)
            await engine.stop()
        assert proc.returncode == code, err.decode()
        assert "Traceback" not in err.decode()

    asyncio.run(scenario())
