"""bench_peers' workloads: the datasets of vLLM's serving client and the project's chat
workloads, at the rates each is played at, on the full and the quick model."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.bench_serving import SERVING
from kvtier.vllm.engines import TINY, ModelShape
from kvtier.vllm.engines.chat_workloads import Workload, documents, multi_turn
from kvtier.vllm.engines.tokenizer import words

INF = math.inf


@dataclass(frozen=True)
class ClientDataset:
    """One dataset of vLLM's serving client: its flags and the rates it is played at."""

    name: str
    reuse: bool
    flags: tuple[str, ...]
    prompts: int
    rates: tuple[float, ...]  # inf: all at once


@dataclass(frozen=True)
class Setup:
    shape: ModelShape
    pool_blocks: int
    max_model_len: int
    datasets: tuple[ClientDataset, ...]
    chats: dict[str, Callable[[int], Workload]]  # by name: seed -> workload
    chat_rates: tuple[float, ...]


def flags(**values: int) -> tuple[str, ...]:
    """The client's dataset flags: `prefix_len=1024` -> `--prefix-len 1024`."""
    return tuple(x for k, v in values.items() for x in ("--" + k.replace("_", "-"), str(v)))


def full_setup() -> Setup:
    vocabulary = words(SERVING.vocab)
    prefix = flags(prefix_repetition_prefix_len=1024, prefix_repetition_suffix_len=64,
                   prefix_repetition_num_prefixes=6, prefix_repetition_output_len=16)  # fmt: skip
    no_reuse = flags(random_input_len=1024, random_output_len=16, random_range_ratio=0)
    return Setup(
        SERVING,
        pool_blocks=128,
        max_model_len=2048,
        datasets=(
            # 6 prefixes of 1,024 tokens (1.5x the pool), 6 prompts each, shuffled
            ClientDataset("prefix_repetition", True, prefix, 36, (1.0, 2.0, 3.0, INF)),
            ClientDataset("random", False, no_reuse, 36, (2.0, INF)),
        ),
        chats={
            # 8 conversations x 3 turns of 512 words: 3x the pool at the end
            "multi_turn": lambda seed: multi_turn(vocabulary, 8, 3, 512, 16, seed),
            # 4 documents of 1,792 words (1.75x the pool), 8 questions each
            "documents": lambda seed: documents(vocabulary, 4, 1792, 8, 32, 16, seed),
        },
        chat_rates=(1.0, INF),
    )


def quick_setup() -> Setup:
    vocabulary = words(TINY.vocab)
    # 4 prefixes of 256 tokens: 1.3x the pool
    prefix = flags(prefix_repetition_prefix_len=256, prefix_repetition_suffix_len=16,
                   prefix_repetition_num_prefixes=4, prefix_repetition_output_len=8)  # fmt: skip
    no_reuse = flags(random_input_len=128, random_output_len=8, random_range_ratio=0)
    return Setup(
        TINY,
        pool_blocks=24,
        max_model_len=512,
        datasets=(
            ClientDataset("prefix_repetition", True, prefix, 8, (4.0, INF)),
            ClientDataset("random", False, no_reuse, 8, (INF,)),
        ),
        chats={"multi_turn": lambda seed: multi_turn(vocabulary, 4, 2, 200, 8, seed)},
        chat_rates=(INF,),
    )
