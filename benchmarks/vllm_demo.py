"""`make vllm-demo`: a real vLLM engine on a multi-turn workload, without and with kvtier.

    .venv/bin/python -m benchmarks.vllm_demo [--chats 3] [--turns 3] [--kvtier '{...}']

A few chats whose every turn resends the whole conversation so far plus a new message,
with other traffic between the turns: the engine's small pool (vLLM's own prefix cache)
cannot keep a chat until its next turn, so without offloading every turn recomputes
the conversation; with kvtier the evicted blocks come back from its tiers. The same
requests run on engines without and with kvtier (vLLM's CPU build here: a Qwen2-style
model with dummy weights, nothing downloaded), and each request's time to first token
is printed side by side.

The two sides are made comparable (kvtier.vllm.engines.compare): the same CPU binding
and warm-up, both engines up at once and each request served on one, then the other
(which goes first alternates); the requests that neither side found cached must then
take the same time on both, and the table says whether they did.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.vllm import transfer_config
from kvtier.vllm.engines import (
    EngineJob,
    JobResult,
    ModelShape,
    Round,
    random_prompts,
    write_model,
)
from kvtier.vllm.engines.compare import (
    RESERVED_CPUS_ENV,
    Agreement,
    cold_agreement,
    same_cpus_env,
)
from kvtier.vllm.engines.stepwise import IDLE_S, run_interleaved

MODEL = ModelShape(
    "qwen2", layers=8, hidden=512, heads=8, kv_heads=2, intermediate=1408, vocab=32000
)
BLOCK = 32
POOL_BLOCKS = 80  # 2,560 tokens: the pool holds about two conversations
# The kvtier side's extra config (kv_connector_extra_config keys, README "With vLLM");
# --kvtier replaces it. 1 GiB of CPU memory holds every conversation here.
DEFAULT_KVTIER: dict[str, Any] = {"cpu_bytes_to_use": 1 << 30}
ALONE, KVTIER = "vLLM alone", "vLLM + kvtier"


@dataclass(frozen=True)
class Workload:
    rounds: tuple[Round, ...]
    labels: tuple[tuple[str, ...], ...]  # per round, per request: "chat 1 turn 2" or ""
    prompt_tokens: tuple[tuple[int, ...], ...]


def multi_turn(chats: int, turns: int, first: int, step: int, others: int) -> Workload:
    """Turn t of a chat is its turn t-1 prompt plus `step` new tokens (the model's
    reply and the user's next message); `others` one-off prompts follow every turn."""
    conversations = [list(p) for p in random_prompts(chats, first, MODEL.vocab, seed=7)]
    rounds, labels, lengths = [], [], []
    for turn in range(turns):
        if turn:
            growth = random_prompts(chats, step, MODEL.vocab, seed=100 + turn)
            for conversation, more in zip(conversations, growth, strict=True):
                conversation.extend(more)
        other = random_prompts(others, first + step, MODEL.vocab, seed=1000 + turn)
        prompts = (*(tuple(c) for c in conversations), *other)
        rounds.append(Round(prompts, max_tokens=1, logprobs=1, name=f"turn {turn + 1}"))
        labels.append((*(f"chat {c + 1} turn {turn + 1}" for c in range(chats)), *([""] * others)))
        lengths.append(tuple(len(p) for p in prompts))
    return Workload(tuple(rounds), tuple(labels), tuple(lengths))


def engine_job(model: Path, workload: Workload, kv_transfer_config: Any) -> EngineJob:
    longest = max(n for round_lengths in workload.prompt_tokens for n in round_lengths)
    return EngineJob(
        model=model,
        rounds=workload.rounds,
        weights=False,
        block_size=BLOCK,
        num_blocks=POOL_BLOCKS,
        max_model_len=(longest // BLOCK + 2) * BLOCK,
        kv_transfer_config=kv_transfer_config,
        # both sides compute on the same cores (kvtier.vllm.engines.compare)
        env={"VLLM_LOGGING_LEVEL": "WARNING", **same_cpus_env()},
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def table(workload: Workload, results: dict[str, JobResult]) -> Table:
    """Each request on both sides, and the check that the requests cached on neither
    side took the same time on both."""
    alone, kvtier = results[ALONE], results[KVTIER]
    out = Table(title="Time to first token: vLLM alone vs vLLM + kvtier")
    for column in ("request", "prompt", "cached", "TTFT", "cached+kvtier", "TTFT+kvtier", "x"):
        out.add_column(column, justify="left" if column == "request" else "right")
    totals = [0.0, 0.0]
    for r, labels in enumerate(workload.labels):
        for i, label in enumerate(labels):
            a, b = alone.rounds[r][i], kvtier.rounds[r][i]
            totals[0] += a.wall_s
            totals[1] += b.wall_s
            out.add_row(
                label or "[dim]other traffic[/dim]",
                str(workload.prompt_tokens[r][i]),
                str(a.num_cached_tokens),
                _ms(a.wall_s),
                str(b.num_cached_tokens),
                _ms(b.wall_s),
                f"{a.wall_s / b.wall_s:.1f}",
            )
    out.add_section()
    cold = cold_agreement(results)
    out.add_row(
        f"cold ({cold.pairs} requests; x: median)",
        "",
        "",
        f"{cold.seconds[ALONE]:.2f} s",
        "",
        f"{cold.seconds[KVTIER]:.2f} s",
        f"{cold.median_ratio:.2f}",
    )
    out.add_row(
        "all requests",
        "",
        "",
        f"{totals[0]:.2f} s",
        "",
        f"{totals[1]:.2f} s",
        f"{totals[0] / totals[1]:.1f}",
    )
    out.caption = fairness_note(cold)
    return out


def fairness_note(cold: Agreement) -> str:
    """How the two sides were made comparable, and whether their cold requests agree."""
    verdict = "agree within noise" if cold.within_noise else "DIFFER by more than noise"
    return (
        f"Comparable sides: the same CPU binding ({RESERVED_CPUS_ENV}="
        f"{same_cpus_env()[RESERVED_CPUS_ENV]}; without it vLLM's CPU build gives the "
        f"engine with a connector more cores) and warm-up; both engines up at once, "
        f"serving each request in turn, the side going first alternating, each request "
        f"after {IDLE_S:g} s with both engines idle. Cold requests "
        f"(nothing cached on either side): vLLM alone slower in {cold.slower[ALONE]}, "
        f"kvtier in {cold.slower[KVTIER]} of {cold.pairs}: {verdict} (sign test "
        f"p={cold.p_value:.2f})."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--first", type=int, default=512, help="tokens of a chat's first turn")
    parser.add_argument("--step", type=int, default=256, help="tokens each turn adds")
    parser.add_argument("--others", type=int, default=2, help="one-off prompts after each turn")
    parser.add_argument(
        "--kvtier",
        type=json.loads,
        default=DEFAULT_KVTIER,
        help=f"kvtier's extra config as JSON (default {json.dumps(DEFAULT_KVTIER)})",
    )
    args = parser.parse_args(argv)
    console = Console()
    workload = multi_turn(args.chats, args.turns, args.first, args.step, args.others)
    config = transfer_config(**args.kvtier)  # checked before any engine starts
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        model = write_model(Path(tmp) / "model", MODEL, weights=False)
        jobs = {
            ALONE: engine_job(model, workload, None),
            KVTIER: engine_job(model, workload, config),
        }
        with console.status("starting both engines, then serving the chats on each in turn"):
            runs = run_interleaved(jobs)
    for side, result in runs.items():
        console.print(f"{side}: engine started in {result.start_s:.0f} s")
    console.print(table(workload, runs))
    console.print(
        f"kvtier config: {json.dumps(config['kv_connector_extra_config'])}\n"
        f"model: {MODEL.layers} layers, hidden {MODEL.hidden}, dummy weights; engine pool "
        f"{POOL_BLOCKS} blocks of {BLOCK} tokens; vLLM's CPU build on this machine."
    )


if __name__ == "__main__":
    main()
