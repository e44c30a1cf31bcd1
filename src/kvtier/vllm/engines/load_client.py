"""An open-loop client for an OpenAI server: Poisson arrivals, streamed chat completions.

vLLM 0.32's own benchmark client (`vllm.benchmarks.serve`) does not fit: its request
functions keep no `usage.prompt_tokens_details.cached_tokens` (the figure that shows
what a cache served) and no per-request answer a later turn could carry, its datasets
have no conversation whose next turn holds the server's previous answer, and `vllm
bench serve` is the `vllm` command, which fails on vLLM's CPU build. This one is small,
on aiohttp (which vLLM installs).

Open loop: request i of a workload arrives at the i-th time of a seeded Poisson process
at the given rate (all at once with `rate=inf`), whatever the server is doing, and is
sent then, or, when it is a later turn of a conversation still waiting for its previous
answer, as soon as that answer is in (a user cannot send a turn before reading the
answer). TTFT is measured from the send to the first streamed token; the inter-token
latencies are the gaps between the streamed chunks that carry a token.

One by one (`run_one_by_one`): each request is sent once the one before is answered,
so a run's cache states, and its figures, are the same every time; the router's engine
test and benchmark play their conversations so, through the router, and read which
engine answered each request from the router's `X-Kvtier-Engine` header. A `before`
hook runs just before each send (the router's test kills an engine there).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtier.router.config import ENGINE_HEADER
from kvtier.vllm.engines.chat_workloads import Workload

# Called with a request's index in arrival order just before it is sent.
BeforeSend = Callable[[int], None]


@dataclass(frozen=True)
class Answer:
    session: int
    turn: int
    ok: bool
    sent_s: float  # since the run's start
    ttft_s: float
    done_s: float  # since the run's start
    itl_s: tuple[float, ...]
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    text: str
    error: str = ""
    # the HTTP status, or the code of an error vLLM sent inside a stream after its 200;
    # 0 when no answer came (the connection failed)
    status: int = 0
    engine: str = ""  # who answered, where a kvtier router says (its X-Kvtier-Engine)


CLIENT_KEEPALIVE_S = 2.0  # under the server's 5 s (see `_run`)


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """`n` arrival times (seconds from the start) of a Poisson process at `rate` per second."""
    if rate <= 0:
        raise ValueError(f"rate={rate}; a request rate is > 0 (inf: all at once)")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def messages_of(workload: Workload, session: int, answers: Sequence[str]) -> list[dict[str, str]]:
    """The chat of `session` at its turn `len(answers)`: its history and the next message."""
    s = workload.sessions[session]
    chat = [{"role": "system", "content": s.system}] if s.system is not None else []
    for said, answer in zip(s.users, answers, strict=False):
        chat += [{"role": "user", "content": said}, {"role": "assistant", "content": answer}]
    chat.append({"role": "user", "content": s.users[len(answers)]})
    return chat


def run_load(
    url: str,
    model: str,
    workload: Workload,
    rate: float,
    seed: int = 0,
    timeout_s: float = 900,
    before: BeforeSend | None = None,
) -> list[Answer]:
    """Play `workload` against the server at `url` at `rate` requests per second (open
    loop); every request's answer, in arrival order.

    `before(i)` runs just before request `i` (in arrival order) is sent, on the
    client's event loop: it holds every other send while it runs."""
    times = arrivals(workload.requests, rate, seed)
    return asyncio.run(_run(url, model, workload, times, timeout_s, before))


def run_one_by_one(
    url: str,
    model: str,
    workload: Workload,
    timeout_s: float = 900,
    before: BeforeSend | None = None,
) -> list[Answer]:
    """Play `workload` one request at a time (each sent when the one before is answered):
    what each request costs on a server with nothing else to do.

    `before(i)` runs just before request `i` is sent, with nothing in flight: a fault
    injected there (an engine killed) meets the next request, not one half answered."""
    return asyncio.run(_run(url, model, workload, None, timeout_s, before))


async def _run(
    url: str,
    model: str,
    workload: Workload,
    times: list[float] | None,
    timeout_s: float,
    before: BeforeSend | None,
) -> list[Answer]:
    import aiohttp

    one_by_one = times is None
    if times is None:
        times = [0.0] * workload.requests
    said: dict[int, list[str]] = {s: [] for s in range(len(workload.sessions))}
    answered: dict[tuple[int, int], asyncio.Event] = {
        key: asyncio.Event() for key in workload.order
    }
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # vLLM's server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and
    # aiohttp keeps one for 15 s: a request sent on one the server was closing failed with
    # "Server disconnected" (twice in bench_serving runs, the server unharmed). Idle
    # connections are dropped here first.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        start = time.perf_counter()

        async def one(i: int, at: float, session: int, turn: int) -> Answer:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if turn > 0:
                await answered[(session, turn - 1)].wait()
            if one_by_one and i > 0:
                await answered[workload.order[i - 1]].wait()
            if before is not None:
                before(i)
            body = {
                "model": model,
                "messages": messages_of(workload, session, said[session]),
                "max_tokens": workload.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                answer = await _stream(http, url + "/v1/chat/completions", body, start)
            except (aiohttp.ClientError, TimeoutError) as e:
                now = time.perf_counter() - start
                answer = _failed(now, f"{type(e).__name__}: {e}")
            answer = _at(answer, session, turn)
            said[session].append(answer.text)
            answered[(session, turn)].set()
            return answer

        tasks = [
            one(i, at, s, t)
            for i, (at, (s, t)) in enumerate(zip(times, workload.order, strict=True))
        ]
        return list(await asyncio.gather(*tasks))


async def _stream(http: Any, url: str, body: dict[str, Any], start: float) -> Answer:
    sent = time.perf_counter()
    stamps: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    error = ""
    async with http.post(url, json=body) as response:
        status = response.status
        engine = response.headers.get(ENGINE_HEADER, "")
        if status != 200:
            detail = (await response.text())[:300]
            return _failed(sent - start, f"HTTP {status}: {detail}", status, engine)
        buffer = b""
        async for chunk in response.content.iter_any():
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:  # vLLM reports a failed stream inside it, after a 200
                    error = str(data["error"])
                    code = data["error"].get("code") if isinstance(data["error"], dict) else None
                    status = int(code or 500)
                for choice in data.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        stamps.append(time.perf_counter())
                        text.append(choice["delta"]["content"])
                usage = data.get("usage") or usage
    done = time.perf_counter()
    first = stamps[0] if stamps else done
    return Answer(
        session=-1,
        turn=-1,
        ok=not error and bool(usage),
        sent_s=sent - start,
        ttft_s=first - sent,
        done_s=done - start,
        itl_s=tuple(b - a for a, b in itertools.pairwise(stamps)),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or 0),
        text="".join(text),
        error=error,
        status=status,
        engine=engine,
    )


def _failed(at: float, error: str, status: int = 0, engine: str = "") -> Answer:
    return Answer(-1, -1, False, at, 0.0, at, (), 0, 0, 0, "", error, status, engine)


def _at(answer: Answer, session: int, turn: int) -> Answer:
    return replace(answer, session=session, turn=turn)


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100), linear between the closest ranks; 0 when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q={q}; a percentile is within 0-100")
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class LoadSummary:
    """What a run at one rate gave: throughput over the run's span (the first send to
    the last answer) and latency percentiles over the answered requests."""

    requests: int
    failed: int
    span_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p90_s: float
    prompt_tokens: int
    cached_tokens: int

    @classmethod
    def of(cls, answers: Sequence[Answer]) -> LoadSummary:
        ok = [a for a in answers if a.ok]
        span = max((a.done_s for a in answers), default=0.0) - min(
            (a.sent_s for a in answers), default=0.0
        )
        ttft = [a.ttft_s for a in ok]
        itl = [gap for a in ok for gap in a.itl_s]
        per_s = 1 / span if span > 0 else 0.0
        return cls(
            requests=len(answers),
            failed=len(answers) - len(ok),
            span_s=span,
            requests_per_s=len(ok) * per_s,
            output_tokens_per_s=sum(a.output_tokens for a in ok) * per_s,
            ttft_mean_s=sum(ttft) / len(ttft) if ttft else 0.0,
            ttft_p50_s=percentile(ttft, 50),
            ttft_p90_s=percentile(ttft, 90),
            ttft_p99_s=percentile(ttft, 99),
            itl_p50_s=percentile(itl, 50),
            itl_p90_s=percentile(itl, 90),
            prompt_tokens=sum(a.prompt_tokens for a in ok),
            cached_tokens=sum(a.cached_tokens for a in ok),
        )
