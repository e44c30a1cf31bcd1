"""The disk tier's injected slow I/O (tests and benchmarks only): what it takes, where it
runs, and that it is off unless set."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvtier.store.slow_io import ENV, SlowIO, hook_from_env
from kvtier.types import int_block_hash
from tests.store.test_disk import open_store, payload, read


def test_the_environment_form_parses_and_is_off_when_unset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert SlowIO.parse("read=0.05, write=0.01") == SlowIO(read_s=0.05, write_s=0.01)
    assert SlowIO.parse("write=2") == SlowIO(write_s=2.0)
    assert SlowIO().hook() is None
    monkeypatch.delenv(ENV, raising=False)
    assert hook_from_env() is None
    monkeypatch.setenv(ENV, "read=0.01")
    assert hook_from_env() is not None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("read=-1", "read=-1.0; a finite number of seconds >= 0"),
        ("write=slow", "write='slow'; a number of seconds >= 0"),
        ("write=inf", "a finite number"),
        ("stall=1", "allowed: read=SECONDS, write=SECONDS"),
        ("read", "allowed: read=SECONDS, write=SECONDS"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=ENV) as info:
        SlowIO.parse(text)
    assert message in str(info.value)


def test_the_hook_runs_before_each_block_file_read_and_written(tmp_path: Path) -> None:
    store = open_store(tmp_path, io_threads=2, parallel_min_bytes=0)
    assert store.io_hook is None  # off by default
    calls: list[str] = []
    lock = threading.Lock()

    def record(kind: str) -> None:
        with lock:
            calls.append(kind)

    store.io_hook = record
    hashes = [int_block_hash(i) for i in range(4)]
    store.write(hashes, [payload(i) for i in range(4)])
    assert calls == ["write"] * 4
    assert read(store, 2) == payload(2)
    assert calls == ["write"] * 4 + ["read"]


def test_a_stalled_disk_holds_the_job_until_released(tmp_path: Path) -> None:
    """A hook that waits on an event: the disk stalls until the test lets it go."""
    store = open_store(tmp_path)
    gate, entered = threading.Event(), threading.Event()

    def stall(kind: str) -> None:
        entered.set()
        gate.wait()

    store.io_hook = stall
    writer = threading.Thread(target=store.write, args=([int_block_hash(1)], [payload(1)]))
    writer.start()
    assert entered.wait(30)
    assert int_block_hash(1) not in store  # not readable while its write is held
    gate.set()
    writer.join(30)
    assert read(store, 1) == payload(1)
