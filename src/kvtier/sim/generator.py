"""The built-in workload: a seeded mix of the three shapes that decide KV-cache value.

- multi-turn chats behind a few shared system prompts (popular ones more often):
  each turn re-sends the whole history plus the last answer and a new message;
- agents re-sending a growing tool history after a large shared tool preamble, with
  short gaps between steps (the best case for offloading);
- one-off long documents, read once (the pollution an admission filter must refuse).

The generator reasons in whole blocks (every segment is a multiple of `block_size`
tokens) and chains ids like the engine's hashes: a block id stands for its content
and everything before it, so equal prefixes get equal ids and nothing else does.
Arrivals are a Poisson process of sessions; turns follow after think times.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtier.sim.traces import TraceRequest
from kvtier.sim.workload import Workload


@dataclass(frozen=True)
class GeneratorConfig:
    num_requests: int = 1500
    block_size: int = 16
    # Shares of sessions that are chats, agents and documents.
    mix: tuple[float, float, float] = (0.6, 0.3, 0.1)
    sessions_per_s: float = 2.0
    num_system_prompts: int = 8
    system_prompt_blocks: int = 24
    tool_preamble_blocks: int = 64
    mean_turns: float = 4.0
    mean_message_blocks: float = 6.0
    mean_answer_blocks: float = 8.0
    mean_agent_steps: float = 8.0
    mean_tool_result_blocks: float = 10.0
    mean_document_blocks: float = 160.0
    mean_think_s: float = 20.0
    mean_tool_gap_s: float = 1.5

    def __post_init__(self) -> None:
        if self.num_requests <= 0 or self.block_size <= 0:
            raise ValueError(
                f"num_requests and block_size must be > 0, got "
                f"{self.num_requests} and {self.block_size}"
            )
        if len(self.mix) != 3 or min(self.mix) < 0 or sum(self.mix) <= 0:
            raise ValueError(f"mix must be 3 shares >= 0 with a positive sum, got {self.mix}")
        if self.sessions_per_s <= 0 or self.num_system_prompts <= 0:
            raise ValueError("sessions_per_s and num_system_prompts must be > 0")


class _Chain:
    """Interns (parent id, content) pairs to dense ids: equal prefixes, equal ids."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}
        self._fresh = 0

    def extend(self, prefix: list[int], contents: list[object]) -> list[int]:
        ids = list(prefix)
        parent = ids[-1] if ids else -1
        for content in contents:
            parent = self._ids.setdefault((parent, content), len(self._ids))
            ids.append(parent)
        return ids

    def unique(self, n: int) -> list[object]:
        """Contents seen nowhere else (a user's message, a tool's output)."""
        start = self._fresh
        self._fresh += n
        return list(range(start, start + n))


class _Generator:
    def __init__(self, config: GeneratorConfig, seed: int) -> None:
        self.c = config
        self.rng = random.Random(seed)
        self.chain = _Chain()
        self.requests: list[TraceRequest] = []

    def blocks(self, mean: float) -> int:
        return max(1, round(self.rng.expovariate(1.0 / mean)))

    def emit(self, t: float, ids: list[int], answer_blocks: int) -> None:
        bs = self.c.block_size
        self.requests.append(
            TraceRequest(t * 1000.0, len(ids) * bs, answer_blocks * bs, tuple(ids))
        )

    def system_prompt(self, name: str, index: int, n: int) -> list[object]:
        return [(name, index, j) for j in range(n)]

    def chat(self, t: float) -> None:
        # Zipf-like popularity: prompt k is chosen with weight 1/(k+1).
        k = self.rng.choices(
            range(self.c.num_system_prompts),
            weights=[1 / (i + 1) for i in range(self.c.num_system_prompts)],
        )[0]
        ids = self.chain.extend([], self.system_prompt("sys", k, self.c.system_prompt_blocks))
        for _ in range(self.blocks(self.c.mean_turns)):
            ids = self.chain.extend(ids, self.chain.unique(self.blocks(self.c.mean_message_blocks)))
            answer = self.blocks(self.c.mean_answer_blocks)
            self.emit(t, ids, answer)
            ids = self.chain.extend(ids, self.chain.unique(answer))
            t += self.rng.expovariate(1.0 / self.c.mean_think_s)

    def agent(self, t: float) -> None:
        ids = self.chain.extend([], self.system_prompt("tools", 0, self.c.tool_preamble_blocks))
        ids = self.chain.extend(ids, self.chain.unique(self.blocks(self.c.mean_message_blocks)))
        for _ in range(self.blocks(self.c.mean_agent_steps)):
            self.emit(t, ids, 2)
            result = self.blocks(self.c.mean_tool_result_blocks)
            ids = self.chain.extend(ids, self.chain.unique(2 + result))
            t += self.rng.expovariate(1.0 / self.c.mean_tool_gap_s)

    def document(self, t: float) -> None:
        ids = self.chain.extend([], self.chain.unique(self.blocks(self.c.mean_document_blocks)))
        self.emit(t, ids, self.blocks(self.c.mean_answer_blocks))

    def run(self) -> list[TraceRequest]:
        t = 0.0
        kinds = (self.chat, self.agent, self.document)
        while len(self.requests) < self.c.num_requests:
            t += self.rng.expovariate(self.c.sessions_per_s)
            self.rng.choices(kinds, weights=self.c.mix)[0](t)
        # Sessions starting later still send turns before the N-th arrival: keep
        # generating until none can, so the first N requests are the true first N.
        cutoff = sorted(r.timestamp for r in self.requests)[self.c.num_requests - 1] / 1000.0
        while t < cutoff:
            t += self.rng.expovariate(self.c.sessions_per_s)
            self.rng.choices(kinds, weights=self.c.mix)[0](t)
        self.requests.sort(key=lambda r: r.timestamp)
        return self.requests[: self.c.num_requests]


def generate_workload(config: GeneratorConfig | None = None, seed: int = 0) -> Workload:
    """A reproducible workload: the same config and seed give the same requests."""
    config = config or GeneratorConfig()
    requests = _Generator(config, seed).run()
    return Workload(f"generated(seed={seed})", tuple(requests), config.block_size, True)
