"""The serving benchmark's parts that need no vLLM server: arrivals, workloads,
percentiles, reading kvtier's figures out of a /metrics scrape, and what the client
keeps of a streamed answer (against a stand-in server on loopback)."""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from benchmarks.bench_serving import by_thread

from kvtier.vllm.engines.chat_workloads import Workload, documents, multi_turn, unique
from kvtier.vllm.engines.load_client import arrivals, messages_of, percentile, run_one_by_one
from kvtier.vllm.engines.openai_server import kvtier_counters
from kvtier.vllm.engines.sessions import (
    compute_cores,
    move_processes,
    session_cpu_seconds,
    session_thread_cpu_seconds,
)

WORDS = [f"w{i}" for i in range(100)]


def test_arrivals_are_a_seeded_poisson_process_at_the_rate() -> None:
    times = arrivals(4000, 8.0, seed=3)
    assert times == arrivals(4000, 8.0, seed=3) and times[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) > 0
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate=0"):
        arrivals(3, 0.0, seed=0)


def test_a_later_turn_carries_the_history_and_the_answers() -> None:
    chat = multi_turn(WORDS, conversations=3, turns=2, words_per_turn=5, max_tokens=4)
    assert chat.order == ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1))
    said = chat.sessions[1].users
    assert messages_of(chat, 1, ["w7 w8"]) == [
        {"role": "user", "content": said[0]},
        {"role": "assistant", "content": "w7 w8"},
        {"role": "user", "content": said[1]},
    ]
    docs = documents(WORDS, 2, 50, 3, 4, 4)
    assert docs.requests == 6 and len({s.system for s in docs.sessions}) == 2
    assert messages_of(docs, 0, [])[0]["role"] == "system"
    assert len({s.users for s in unique(WORDS, 5, 20, 4).sessions}) == 5


def test_a_turn_before_the_one_it_follows_is_refused() -> None:
    chat = multi_turn(WORDS, 1, 2, 5, 4)
    with pytest.raises(ValueError, match="session 0 turn 1 arrives out of turn order"):
        Workload("bad", chat.sessions, ((0, 1), (0, 0)), 4)


def test_percentiles_interpolate_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([], 90) == 0.0
    with pytest.raises(ValueError, match="q=101"):
        percentile(values, 101)


def test_kvtier_counters_by_tier() -> None:
    scrape = "\n".join(
        [
            "# TYPE vllm:kvtier_hit_blocks_total counter",
            'vllm:kvtier_hit_blocks_total{engine="0",model_name="m",tier="cpu"} 12.0',
            'vllm:kvtier_hit_blocks_created{engine="0",model_name="m",tier="cpu"} 1.7e9',
            'vllm:kvtier_lookup_blocks_total{engine="0",model_name="m",tier="cpu"} 20.0',
            'vllm:kvtier_used_blocks{engine="0",model_name="m",tier="disk"} 3.0',
            'vllm:kvtier_lookup_seconds_bucket{le="0.1",tier="redis"} 2.0',
            'vllm:num_requests_running{engine="0"} 1.0',
        ]
    )
    assert kvtier_counters(scrape) == {
        "cpu": {"hit_blocks": 12.0, "lookup_blocks": 20.0},
        "disk": {"used_blocks": 3.0},
    }


class _StandIn(BaseHTTPRequestHandler):
    """A router-fronted engine in miniature: request 1 gets a 503, request 2 a stream
    that fails after its 200 (as vLLM reports one), the others a one-token answer;
    each says which engine answered, as kvtier's router does."""

    log: list[str]

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = sum(e.startswith("served") for e in self.log)
        self.log.append(f"served {n}")
        if n == 1:
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"no engine answered")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("X-Kvtier-Engine", f"e{n % 2}")
        self.end_headers()
        usage = {
            "prompt_tokens": len(body["messages"]),
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": n},
        }
        chunks: list[object] = [{"choices": [{"delta": {"content": f"w{n}"}}]}]
        chunks.append({"error": {"code": 400, "message": "bad"}} if n == 2 else {"usage": usage})
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[tuple[str, list[str]]]:
    log: list[str] = []
    handler = type("Handler", (_StandIn,), {"log": log, "protocol_version": "HTTP/1.0"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()
        server.server_close()


def test_one_by_one_keeps_status_engine_and_runs_the_hook_between_requests(
    stand_in: tuple[str, list[str]],
) -> None:
    url, log = stand_in
    chat = multi_turn(WORDS, conversations=2, turns=2, words_per_turn=3, max_tokens=1)
    answers = run_one_by_one(url, "m", chat, before=lambda i: log.append(f"before {i}"))
    # the hook runs before each send, never with a request in flight
    assert log == [e for i in range(4) for e in (f"before {i}", f"served {i}")]
    assert [(a.session, a.turn) for a in answers] == list(chat.order)
    assert [a.status for a in answers] == [200, 503, 400, 200]
    assert [a.ok for a in answers] == [True, False, False, True]
    assert [a.engine for a in answers] == ["e0", "", "e0", "e1"]
    assert answers[1].error.startswith("HTTP 503: no engine answered")
    assert answers[3].text == "w3" and answers[3].cached_tokens == 3
    assert answers[3].prompt_tokens == 3  # its history: the first turn, its answer, then it


BURN = """
import sys, time
started = time.process_time()
while time.process_time() - started < 0.3:
    pass
print("burnt", flush=True)
sys.stdin.read()
"""
LEADER = (
    f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {BURN!r}]); exec({BURN!r})"
)


def test_a_servers_cpu_is_every_process_of_its_session() -> None:
    """What bench_serving reports per side and run (`server_cpu_s`): a session of two
    processes that burnt 0.3 CPU s each counts at least 0.6, less what the kernel's
    counts in whole clock ticks leave out (under a tick of user and one of system time
    a process: a CI run counted 0.59)."""
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER],
        stdin=subprocess.PIPE,  # the child's too: both wait for its end
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert leader.stdout is not None
        assert [leader.stdout.readline() for _ in range(2)] == ["burnt\n"] * 2
        ticks_left_out = 2 * 2 / os.sysconf("SC_CLK_TCK")
        assert session_cpu_seconds(leader.pid) >= 0.6 - ticks_left_out
    finally:
        leader.communicate("")
    assert leader.returncode == 0


def test_a_servers_cpu_by_thread_names_the_thread_that_took_it() -> None:
    """What bench_serving reports per side and run (`server_cpu_by_thread`): a thread
    named in the kernel's lists (`kvtier.thread_names`) that burnt 0.3 CPU s counts
    under its process's title and its name."""
    child = """
import sys, threading, time
def burn():
    open(f"/proc/self/task/{threading.get_native_id()}/comm", "w").write("kv-burn")
    started = time.thread_time()
    while time.thread_time() - started < 0.3:
        pass
    print("burnt", flush=True)
    sys.stdin.read()
threading.Thread(target=burn).start()
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "burnt\n"
        threads = session_thread_cpu_seconds(proc.pid)
        (key,) = [k for k in threads if k.endswith("/kv-burn")]
        ticks_left_out = 2 / os.sysconf("SC_CLK_TCK")
        assert threads[key] >= 0.3 - ticks_left_out
        used = by_thread({}, threads)
        assert next(iter(used)) == key  # the most first
        assert all(v >= 0.05 for v in used.values())
        assert by_thread(threads, threads) == {}  # nothing between two equal readings
    finally:
        proc.communicate("")
    assert proc.returncode == 0


WORKER = """
import os, sys, threading
open("/proc/self/comm", "w").write("VLLM::Worker")
os.sched_setaffinity(0, {int(sys.argv[1])})  # as vLLM binds a worker's compute thread
threading.Thread(target=sys.stdin.read, daemon=True).start()
print("bound", flush=True)
sys.stdin.read()
"""


def test_the_cores_a_sessions_workers_compute_on_and_moving_a_process_off_them() -> None:
    """How bench_serving keeps the stand-in for a remote Redis off the engines' compute
    cores: the cores of the session's `VLLM::Worker` processes, and every thread of a
    process moved onto the others."""
    last = (os.cpu_count() or 1) - 1
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(last)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "bound\n"
        assert compute_cores([worker.pid]) == (set() if last == 0 else {last})
        assert compute_cores([os.getsid(0)]) == set()  # no worker in this session
        move_processes([worker.pid], {0})
        tasks = list(Path(f"/proc/{worker.pid}/task").iterdir())
        assert len(tasks) == 2
        assert all(os.sched_getaffinity(int(t.name)) == {0} for t in tasks)
    finally:
        worker.communicate("")
