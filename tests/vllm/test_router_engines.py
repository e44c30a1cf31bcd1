"""The router in front of two real vLLM OpenAI servers (CPU build, the tiny model,
kvtier's CPU tier, KV events over ZMQ): multi-turn conversations (`multi_turn`) sent
one request at a time and streamed by the serving benchmark's client, through
round-robin and through the KV-aware router, then once more with an engine killed
mid-run. The router's `X-Kvtier-Engine` header says which engine answered.

The two servers start once and serve every case (a start is 20-90 s here); each case
talks about its own conversations (different words), so no case finds another's
blocks. The run is shared between workers like the other engine scenarios.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.router import Router, RouterConfig, router_thread
from kvtier.router.replay import replay_engines
from kvtier.sim import ReplayConfig
from kvtier.sim.traces import read_tokens
from kvtier.sim.workload import Workload
from kvtier.vllm.engines import TINY
from kvtier.vllm.engines.chat_workloads import multi_turn
from kvtier.vllm.engines.load_client import Answer, BeforeSend, run_one_by_one
from kvtier.vllm.engines.openai_server import running_servers
from kvtier.vllm.engines.router_servers import (
    BLOCK,
    MAX_TOKENS,
    POOL_BLOCKS,
    SERVED_NAME,
    engine_spec,
    router_configs,
)
from kvtier.vllm.engines.tokenizer import chat_model, words
from tests.vllm.conftest import EngineRuns

CONVERSATIONS, TURNS, WORDS = 5, 3, 100  # an odd count: round-robin alternates engines
KILL_BEFORE = CONVERSATIONS + 2  # the third request of the second turns


@dataclass(frozen=True)
class RouterScenario:
    round_robin: tuple[Answer, ...]
    kv: tuple[Answer, ...]
    kv_prompts: tuple[tuple[int, ...], ...]  # the KV run's prompts as the router hashed them
    killed: tuple[Answer, ...]
    killed_taken_out: int  # times the router took the killed engine out
    killed_retries: int
    kv_trail: str  # the KV run's router state and decisions, for a failure's message


@pytest.fixture(scope="session")
def router_scenario(engine_runs: EngineRuns, tiny_model: Path) -> RouterScenario:
    def quietly(workdir: Path) -> RouterScenario:
        with warnings.catch_warnings():  # transformers' and vLLM's, in the router's thread
            warnings.simplefilter("ignore")
            return _play(tiny_model, workdir)

    return engine_runs.once("router-scenario", quietly)


def _play(source: Path, workdir: Path) -> RouterScenario:
    model = chat_model(source, workdir / "model", TINY.vocab)
    configs = router_configs(model, TINY, workdir / "servers")
    with running_servers(configs, workdir / "servers") as servers:
        specs = tuple(engine_spec(s) for s in servers.values())

        def router(policy: str) -> Router:
            # a loaded 2-core machine can keep a server's /health, or the router's own
            # connection to it, waiting for seconds
            config = RouterConfig(
                specs,
                BLOCK,
                str(model),
                policy=policy,
                health_timeout_s=10,
                connect_timeout_s=10,
            )
            return Router(config, keep_decisions=1000)

        def run(
            policy: str, seed: int, before: BeforeSend | None = None
        ) -> tuple[list[Answer], Router]:
            r = router(policy)
            talk = multi_turn(words(TINY.vocab), CONVERSATIONS, TURNS, WORDS, MAX_TOKENS, seed)
            with router_thread(r) as port:
                url = f"http://127.0.0.1:{port}"
                return run_one_by_one(url, SERVED_NAME, talk, before=before), r

        rr, _ = run("round-robin", 1)
        kv, kv_router = run("kv", 2)

        def kill(k: int) -> None:
            if k == KILL_BEFORE:
                servers["e1"].kill()

        killed, killed_router = run("kv", 3, before=kill)
        state = killed_router.engines["e1"]
        return RouterScenario(
            tuple(rr),
            tuple(kv),
            tuple(d.tokens for d in kv_router.decisions),
            tuple(killed),
            state.taken_out,
            killed_router.counters.retries,
            _trail(kv_router),
        )


def _trail(router: Router) -> str:
    """What the router saw: each engine's outages and event stream, each decision."""
    lines = [f"retries {router.counters.retries}, reasons {router.counters.by_reason}"]
    for name, state in router.engines.items():
        events = state.subscriber.counters if state.subscriber else None
        lines.append(f"{name}: taken out {state.taken_out}, failures {state.failures}, {events}")
    lines += [
        f"{k}: {d.engine} ({d.reason}, {d.cached_blocks} of {d.prompt_blocks} blocks)"
        for k, d in enumerate(router.decisions)
    ]
    return "\n".join(lines)


def _cached(turns: tuple[Answer, ...]) -> int:
    return sum(t.cached_tokens for t in turns)


def test_every_request_is_answered(router_scenario: RouterScenario) -> None:
    for turns in (router_scenario.round_robin, router_scenario.kv, router_scenario.killed):
        assert [t.status for t in turns] == [200] * CONVERSATIONS * TURNS
        assert [t.error for t in turns if not t.ok] == []


def test_kv_routing_caches_at_least_1_8x_round_robin(router_scenario: RouterScenario) -> None:
    kv, rr = _cached(router_scenario.kv), _cached(router_scenario.round_robin)
    assert kv >= 1.8 * rr > 0, (kv, rr)


def test_every_returning_turn_goes_to_the_engine_that_holds_it(
    router_scenario: RouterScenario,
) -> None:
    by_turn = {(t.session, t.turn): t for t in router_scenario.kv}
    for (c, t), turn in by_turn.items():
        if t == 0:
            continue
        assert turn.engine == by_turn[(c, t - 1)].engine, ((c, t), router_scenario.kv_trail)
        assert turn.cached_tokens >= by_turn[(c, t - 1)].prompt_tokens // BLOCK * BLOCK
    # round-robin, for contrast, sends half of them elsewhere
    rr = {(t.session, t.turn): t.engine for t in router_scenario.round_robin}
    assert any(rr[(c, t)] != rr[(c, t - 1)] for c, t in rr if t)


def test_an_engine_killed_mid_run_costs_no_answer(router_scenario: RouterScenario) -> None:
    turns = router_scenario.killed
    assert {t.engine for t in turns[:KILL_BEFORE]} == {"e0", "e1"}
    assert {t.engine for t in turns[KILL_BEFORE:]} == {"e0"}
    assert router_scenario.killed_taken_out >= 1
    # the survivor still serves its own conversations from its cache
    assert any(t.cached_tokens for t in turns[KILL_BEFORE:] if t.turn == TURNS - 1)


def test_the_multi_engine_replay_routes_returning_turns_as_the_real_run(
    router_scenario: RouterScenario, tmp_path: Path
) -> None:
    """The KV run's prompts (as the router tokenized them) replayed over two replay
    stacks sized like the servers: every returning turn goes to the same engine."""
    trace = tmp_path / "kv-run.jsonl"
    # a minute apart: one at a time, as they were sent (none in flight at the next)
    lines = [
        json.dumps({"token_ids": list(p), "output_length": MAX_TOKENS, "timestamp": k * 60_000})
        for k, p in enumerate(router_scenario.kv_prompts)
    ]
    trace.write_text("\n".join(lines) + "\n")
    workload = Workload("kv-run", tuple(read_tokens(trace, block_size=BLOCK)), BLOCK, True)
    config = ReplayConfig(gpu_blocks=POOL_BLOCKS, cpu_blocks=4 * POOL_BLOCKS)
    replayed = replay_engines(workload, config, 2, "kv").assignment
    real = [t.engine for t in router_scenario.kv]
    returning = [k for k, t in enumerate(router_scenario.kv) if t.turn > 0]
    assert [replayed[k] for k in returning] == [real[k] for k in returning], (
        router_scenario.kv_trail
    )
    assert list(replayed) == real  # the cold first turns take the same turns too
