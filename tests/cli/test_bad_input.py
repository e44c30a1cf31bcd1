"""Issue 15's bad inputs, given to the `kvtier` command as a user would (a subprocess per
case): each is refused with exit code 2 and one line naming the value, where it came from
and what is allowed, never a traceback. All cases start at once (a Python start costs
~0.5 s; they overlap), then each test checks its own result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvtier
from kvtier.net import free_port
from tests.remote.conftest import RedisServer, serve_redis

SRC = str(Path(kvtier.__file__).resolve().parents[1])
ROW = '{"timestamp":0,"input_length":1024,"output_length":1,"hash_ids":[1,2]}'
TRACES = {
    "huge.jsonl": '{"timestamp":0,"input_length":1024,"output_length":1,'
    '"hash_ids":[1180591620717411303424,2]}',
    "nan.jsonl": '{"timestamp":NaN,"input_length":1024,"output_length":1,"hash_ids":[1,2]}',
    "inf.jsonl": '{"timestamp":Infinity,"input_length":1024,"output_length":1,"hash_ids":[1]}',
    "short.jsonl": '{"timestamp":0,"input_length":1,"output_length":1,'
    '"hash_ids":[1,2,3,4,5,6,7,8,9,10]}',
    "empty.jsonl": "",
    "ok.jsonl": ROW,
    "tokens.jsonl": '{"token_ids":[1,2,"a"],"output_length":1}',
}


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    code: int
    stderr: str  # a substring of the one error line
    stdout_json: bool = False  # --json's document must still be printed


CASES: dict[str, Case] = {
    # 1. hash ids of 2**64 or more (OverflowError before)
    "huge-hash-replay": Case(
        ("replay", "--trace", "huge.jsonl"),
        2,
        "huge.jsonl:1: field 'hash_ids' must hold integers in [0, 18446744073709551615], "
        "got 1180591620717411303424",
    ),
    "huge-hash-compare": Case(
        ("compare", "--trace", "huge.jsonl"), 2, "huge.jsonl:1: field 'hash_ids' must hold"
    ),
    # 2. NaN / Infinity timestamps, more blocks than the input has tokens for
    "nan-timestamp": Case(
        ("replay", "--trace", "nan.jsonl"),
        2,
        "nan.jsonl:1: field 'timestamp' must be a finite number >= 0, got nan",
    ),
    "inf-timestamp": Case(("compare", "--trace", "inf.jsonl"), 2, "got inf"),
    "blocks-beyond-input": Case(
        ("replay", "--trace", "short.jsonl"),
        2,
        "short.jsonl:1: 10 hash_ids but input_length 1 fills at most 1 blocks of 512 tokens",
    ),
    # 3. token ids that are not ints in [0, 2**32)
    "bad-token-id": Case(
        ("replay", "--trace", "tokens.jsonl", "--format", "tokens"),
        2,
        "tokens.jsonl:1: field 'token_ids' must hold integers in [0, 4294967295], got 'a'",
    ),
    # 9. invalid UTF-8 names the file; unwritable outputs are refused before the run,
    # and a report that fails at the end keeps the --json document
    "invalid-utf8": Case(
        ("replay", "--trace", "bad.jsonl"), 2, "bad.jsonl:2: not UTF-8 (byte 0xff at column 1)"
    ),
    "png-dir-missing": Case(
        ("compare", "--png", "no/such/dir/x.png"),
        2,
        "--png no/such/dir/x.png: directory no/such/dir does not exist",
    ),
    "report-is-a-directory": Case(
        ("replay", "--report", "."), 2, "--report .: is a directory, expected a file name"
    ),
    "png-device-full": Case(
        ("compare", "--trace", "ok.jsonl", "--png", "/dev/full", "--json"),
        1,
        "/dev/full: cannot write (No space left on device)",
        stdout_json=True,
    ),
    # 10. an empty trace
    "empty-replay": Case(
        ("replay", "--trace", "empty.jsonl"), 2, "empty.jsonl: the trace holds no requests"
    ),
    "empty-compare": Case(
        ("compare", "--trace", "empty.jsonl"), 2, "empty.jsonl: the trace holds no requests"
    ),
    # 8. sizes refused with the figure, before allocating
    "gpu-blocks-huge": Case(
        ("replay", "--gpu-blocks", str(10**13)),
        2,
        f"--gpu-blocks {10**13}: 1280000.0 GB of bookkeeping), more than the",
    ),
    "disk-blocks-huge": Case(
        ("replay", "--disk-blocks", str(10**13)),
        2,
        f"--disk-blocks {10**13}: 80000.0 GB of slot table), more than the",
    ),
    "cpu-blocks-data-huge": Case(
        ("replay", "--cpu-blocks", str(10**11), "--data"),
        2,
        f"--cpu-blocks {10**11}: 25600.0 GB of KV bytes), more than the",
    ),
    "requests-huge": Case(
        ("replay", "--requests", str(10**10)),
        2,
        f"--requests {10**10}: 46080.0 GB of generated requests), more than the",
    ),
    # 12. flags that do not apply; a negative --mix share
    "store-on-without-gpu": Case(
        ("replay", "--store-on", "evict"),
        2,
        "--store-on applies only with an accelerator tier (--gpu-blocks N > 0)",
    ),
    "mix-with-trace": Case(
        ("compare", "--trace", "ok.jsonl", "--mix", "1,1,1", "--requests", "5"),
        2,
        "--requests and --mix: the generated workload's flags do not apply with --trace",
    ),
    "redis-namespace-without-redis": Case(
        ("replay", "--redis-namespace", "team"),
        2,
        "--redis-namespace applies only with a Redis tier (--redis URL)",
    ),
    # 6. Redis URLs: the part at fault named, the password never printed
    "redis-db-not-a-number": Case(
        ("replay", "--redis", "redis://:s3cr3t@127.0.0.1:1/abc"),
        2,
        "database in the URL path must be an integer >= 0, got 'abc' in "
        "'redis://:***@127.0.0.1:1/abc'",
    ),
    "redis-bad-query-option": Case(
        ("replay", "--redis", "redis://:s3cr3t@127.0.0.1:1/0?socket_timeout=abc"),
        2,
        "option socket_timeout='abc' in the query of 'redis://:***@127.0.0.1:1/0?",
    ),
    "negative-mix": Case(
        ("replay", "--mix", "-1,1,1"),
        2,
        "argument --mix: the share of chats must be a finite number >= 0, got -1 in '-1,1,1'",
    ),
}


def kvtier_env(tmp: Path) -> dict[str, str]:
    """This checkout's kvtier, and a private temporary directory."""
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": SRC + (os.pathsep + path if path else ""),
        "TMPDIR": str(tmp),
    }


def start(argv: tuple[str, ...], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", *argv],
        cwd=cwd,
        env=kvtier_env(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    cwd = tmp_path_factory.mktemp("bad-input")
    for name, text in TRACES.items():
        (cwd / name).write_text(text + ("\n" if text else ""))
    (cwd / "bad.jsonl").write_bytes(ROW.encode() + b"\n\xff\xfe\n")
    running = {name: start(case.argv, cwd) for name, case in CASES.items()}
    return {
        name: (child.wait(), *child.communicate(timeout=120)) for name, child in running.items()
    }


@pytest.mark.parametrize("name", CASES)
def test_refused_with_one_line(results: dict[str, tuple[int, str, str]], name: str) -> None:
    case = CASES[name]
    code, out, err = results[name]
    assert "Traceback" not in err
    assert code == case.code, err
    assert case.stderr in err
    assert err.strip().splitlines()[-1].startswith(f"kvtier {case.argv[0]}: error: ")
    assert "s3cr3t" not in err
    if case.stdout_json:
        assert json.loads(out)["results"]
    else:
        assert out == ""


def test_a_limited_generated_workload_is_generated_only_that_far(tmp_path: Path) -> None:
    """`--requests 3000000 --limit 10` took 116 s and 12.8 GB: it generated everything."""
    child = start(("replay", "--requests", "3000000", "--limit", "10", "--json"), tmp_path)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert json.loads(out)["requests"] == 10


DISK_REPLAY = ("replay", "--requests", "5000", "--cpu-blocks", "500", "--disk-blocks", "5000")
LOCKS = "kvtier-replay-disk-*/kvtier-*/lock"  # the temporary disk tier's, once open


@dataclass
class Stopped:
    """A replay with a disk tier, stopped (SIGSTOP) while its disk directory is open:
    whatever comes next finds it mid-replay, however fast the machine."""

    cwd: Path
    child: subprocess.Popen[str]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Stopped]]:
    """Four disk replays, started at once (their torch imports overlap): SIGINT, SIGTERM
    and SIGKILL each get one, and one owns a --disk-dir that a second replay wants."""
    more = {"sigint": (), "sigterm": (), "sigkill": (), "owner": ("--disk-dir", "dd")}
    replays = {}
    for name, extra in more.items():
        cwd = tmp_path_factory.mktemp(name)
        replays[name] = Stopped(cwd, start((*DISK_REPLAY, "--data", *extra), cwd))
    deadline = time.monotonic() + 120
    for name, replay in replays.items():
        lock = "dd/kvtier-*/lock" if name == "owner" else LOCKS
        while not _stop_if_open(replay, lock):
            assert replay.child.poll() is None, replay.child.communicate()
            assert time.monotonic() < deadline, f"{name}: the replay never opened its disk"
            time.sleep(0.02)  # polling for a file, not timing anything
    yield replays
    for replay in replays.values():
        replay.child.kill()
        replay.child.communicate(timeout=60)


def _stop_if_open(replay: Stopped, lock: str) -> bool:
    if not list(replay.cwd.glob(lock)):
        return False
    replay.child.send_signal(signal.SIGSTOP)
    if list(replay.cwd.glob(lock)):
        return True  # still open once stopped
    replay.child.send_signal(signal.SIGCONT)
    return False


@pytest.mark.parametrize(
    ("name", "sig", "code", "line"),
    [
        ("sigint", signal.SIGINT, 130, "kvtier replay: interrupted"),
        ("sigterm", signal.SIGTERM, 143, "kvtier replay: terminated (SIGTERM)"),
    ],
)
def test_ctrl_c_and_sigterm_exit_with_one_line_and_remove_the_disk_tier(
    stopped: dict[str, Stopped], name: str, sig: signal.Signals, code: int, line: str
) -> None:
    replay = stopped[name]
    replay.child.send_signal(sig)
    replay.child.send_signal(signal.SIGCONT)
    _, err = replay.child.communicate(timeout=60)
    assert (replay.child.returncode, err.strip()) == (code, line)
    assert not list(replay.cwd.glob("kvtier-replay-disk-*")), "temporary disk tier left behind"


def test_a_killed_replays_disk_is_reclaimed_and_a_live_ones_refused(
    stopped: dict[str, Stopped],
) -> None:
    """SIGKILL leaves the temporary disk tier: the next disk replay removes it (12). A
    second replay on a live one's --disk-dir is refused, naming the owner (5)."""
    killed, owner = stopped["sigkill"], stopped["owner"]
    killed.child.kill()
    killed.child.communicate(timeout=60)
    assert list(killed.cwd.glob("kvtier-replay-disk-*"))  # nothing ran to remove it
    argv = ("replay", "--limit", "5", "--cpu-blocks", "20", "--disk-blocks", "40", "--data")
    again = start(argv, killed.cwd)
    second = start((*DISK_REPLAY, "--data", "--disk-dir", "dd"), owner.cwd)
    out, err = second.communicate(timeout=60)
    assert (second.returncode, out) == (2, ""), err
    assert err.startswith("kvtier replay: error: disk tier directory dd/kvtier-")
    assert f"is in use by process {owner.child.pid} (lock dd/kvtier-" in err
    assert again.wait(timeout=60) == 0, again.communicate()
    again.communicate()
    assert not list(killed.cwd.glob("kvtier-replay-disk-*"))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from serve_redis(tmp_path)


def test_redis_at_start_up_one_node_or_a_node_list(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A database the server lacks fails at start like a wrong password (6); an unreachable
    node list degrades with one warning line, like a single node (7: three chained
    tracebacks before)."""
    down = f"redis://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    runs = [
        start(("replay", "--limit", "5", "--redis", url, "--json"), tmp_path)
        for url in (redis_server.url.replace("/0", "/99"), down)
    ]
    (missing_db, missing_out, missing_err), (_, down_out, down_err) = (
        (run.wait(), *run.communicate(timeout=60)) for run in runs
    )
    assert (missing_db, missing_out) == (2, "")
    assert missing_err.startswith(f"kvtier replay: error: remote tier {redis_server.url[:-2]}/99")
    assert "has no database 99 (the URL path" in missing_err
    assert "Traceback" not in down_err and "unreachable at start-up" in down_err
    assert json.loads(down_out)["results"][0]["tiers"]["remote"]["errors"] > 0


def test_a_damaged_layout_marker_in_a_disk_dir_is_named(tmp_path: Path) -> None:
    """Item 11 from the command line: no raw JSONDecodeError, the file named."""
    from kvtier.sim.bytes_plane import small_layout

    directory = tmp_path / "dd" / f"kvtier-{small_layout(16, 'kvtier-replay').fingerprint}"
    directory.mkdir(parents=True)
    (directory / "layout.json").write_text("[1, 2]")
    argv = ("replay", "--limit", "5", "--cpu-blocks", "20", "--disk-blocks", "40", "--data")
    child = start((*argv, "--disk-dir", "dd"), tmp_path)
    out, err = child.communicate(timeout=60)
    assert (child.returncode, out) == (2, ""), err
    assert f"error: dd/{directory.name}/layout.json: layout marker must be a JSON object" in err
