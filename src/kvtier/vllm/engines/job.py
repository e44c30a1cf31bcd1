"""What one engine start serves (`EngineJob`, its `Round`s) and what it returns.

`EngineJob.kv_transfer_config` is the dict vLLM's `--kv-transfer-config` takes (None:
vLLM's baseline engine). Everything here is plain data that crosses into the child
process as JSON (`run.run_job`, `child`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Round:
    """Prompts served one after the other, each alone, greedy."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int = 4
    logprobs: int = 2
    name: str = ""
    # faults injected before the round, while the engine runs: ("kill", PID) sends
    # SIGKILL to a process (a Redis server), ("corrupt", GLOB) flips the last byte of
    # every file matching GLOB (disk block files), ("corrupt_redis", "URL PATTERN") the
    # last byte of every Redis value whose key matches PATTERN; ("redis_resetstat", URL)
    # zeroes the server's command counts (what the round sends it is read after the job)
    before: tuple[tuple[str, str], ...] = ()
    # benchmarks only: idle seconds before the round, for asynchronous stores to finish
    # so that they do not share the CPU with the round's timed requests
    settle_s: float = 0.0


@dataclass(frozen=True)
class EngineJob:
    """One engine start and what it serves."""

    model: Path
    rounds: tuple[Round, ...]
    weights: bool = True  # False: load_format="dummy"
    block_size: int = 32  # vLLM's CPU attention needs a multiple of 32
    num_blocks: int = 24  # the engine's pool (num_gpu_blocks_override), one is vLLM's null block
    max_model_len: int = 512  # at most what the pool holds, or vLLM refuses to start
    max_num_batched_tokens: int | None = None
    kv_transfer_config: dict[str, Any] | None = None
    kv_events_endpoint: str | None = None  # vLLM's ZMQ publisher connects to it
    kv_events_topic: str = "kvtier-test"
    seed: int = 0
    env: dict[str, str] = field(default_factory=dict)
    # workers of a tensor-parallel engine; on the CPU build each needs its own cores
    # (VLLM_CPU_OMP_THREADS_BIND="0|1" in `env`, see `tensor_parallel_env`)
    tensor_parallel_size: int = 1

    def engine_kwargs(self) -> dict[str, Any]:
        """`vllm.LLM(**kwargs)` for this job, JSON-serialisable (the configs stay dicts)."""
        kwargs: dict[str, Any] = {
            "model": str(self.model),
            "load_format": "safetensors" if self.weights else "dummy",
            "skip_tokenizer_init": True,
            "dtype": "float32",  # this CPU has no bf16 instructions; float32 is exact
            "block_size": self.block_size,
            "num_gpu_blocks_override": self.num_blocks,
            # An explicit KV size skips vLLM's check that 92% of the node's memory is
            # free (it never is on a shared machine); the override then sets the pool.
            "kv_cache_memory_bytes": 1 << 30,
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": True,
            "enforce_eager": True,
            "max_num_seqs": 4,
            "seed": self.seed,
            "disable_log_stats": False,  # RequestOutput.metrics carries the TTFT
        }
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.tensor_parallel_size != 1:
            kwargs["tensor_parallel_size"] = self.tensor_parallel_size
        if self.kv_transfer_config is not None:
            kwargs["kv_transfer_config"] = self.kv_transfer_config
        if self.kv_events_endpoint is not None:
            kwargs["kv_events_config"] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,
                "topic": self.kv_events_topic,
            }
        return kwargs

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine_kwargs(),
            "rounds": [asdict(r) for r in self.rounds],
            "env": self.env,
        }


@dataclass(frozen=True)
class RequestResult:
    token_ids: tuple[int, ...]
    # per generated position: {token id: logprob} of the top `logprobs` tokens (and the chosen)
    logprobs: tuple[dict[int, float], ...]
    num_cached_tokens: int
    wall_s: float  # submit to final output; with max_tokens=1 that is the TTFT
    ttft_s: float | None  # the engine's own first-token latency, when it reports one

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RequestResult:
        return cls(
            token_ids=tuple(raw["token_ids"]),
            logprobs=tuple({int(k): v for k, v in pos.items()} for pos in raw["logprobs"]),
            num_cached_tokens=raw["num_cached_tokens"],
            wall_s=raw["wall_s"],
            ttft_s=raw["ttft_s"],
        )


@dataclass(frozen=True)
class JobResult:
    start_s: float  # LLM(...) until it returned: the engine's start
    rounds: tuple[tuple[RequestResult, ...], ...]
    log: str  # the engine's output (stdout and stderr), for failures
    round_names: tuple[str, ...] = ()

    def round(self, name: str) -> tuple[RequestResult, ...]:
        if name not in self.round_names:
            raise KeyError(f"no round named {name!r}; this job has {list(self.round_names)}")
        return self.rounds[self.round_names.index(name)]

    @classmethod
    def from_json(cls, raw: dict[str, Any], log: str, names: tuple[str, ...]) -> JobResult:
        rounds = tuple(tuple(RequestResult.from_json(r) for r in rnd) for rnd in raw["rounds"])
        return cls(start_s=raw["start_s"], rounds=rounds, log=log, round_names=names)


def tensor_parallel_env(workers: int) -> dict[str, str]:
    """The CPU build's thread binding for `workers` workers: one core each (wrapping
    around when the machine has fewer cores than workers)."""
    cores = os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % cores) for i in range(workers))}
