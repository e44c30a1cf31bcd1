"""Real vLLM engines in child processes, for `make vllm-demo`, the benchmarks and the tests.

Each engine runs in its own child process (`run_job`), serves one `EngineJob` (rounds of
prompts, each request alone so that its wall time is its own) and returns a `JobResult`.
Nothing here imports vLLM: only the child does, so callers run without it until they
start an engine. `stepwise` keeps several engines up and serves them request by request,
and `compare` what makes engines' timings comparable (with and without a connector).
"""

from __future__ import annotations

from kvtier.vllm.engines.job import (
    EngineJob,
    JobResult,
    RequestResult,
    Round,
    tensor_parallel_env,
)
from kvtier.vllm.engines.model import (
    QWEN2_05B,
    QWEN2_05B_HYBRID,
    TINY,
    TINY_HYBRID,
    ModelShape,
    write_model,
)
from kvtier.vllm.engines.prompts import random_prompts
from kvtier.vllm.engines.run import run_job

__all__ = [
    "QWEN2_05B",
    "QWEN2_05B_HYBRID",
    "TINY",
    "TINY_HYBRID",
    "EngineJob",
    "JobResult",
    "ModelShape",
    "RequestResult",
    "Round",
    "random_prompts",
    "run_job",
    "tensor_parallel_env",
    "write_model",
]
