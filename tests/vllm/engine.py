"""Real vLLM engines for the engine tests, `make vllm-demo` and benchmarks/bench_vllm.py.

Each engine runs in a child process (`python -m tests.vllm.engine_run JOB OUT`): vLLM
spawns its engine core and worker processes, sets thread and NUMA bindings, and holds
gigabytes; a child keeps all of that out of the pytest process and ends it for sure.
One engine start (~20-60 s on 2 cores) serves a whole job: several rounds of prompts,
each request generated alone so that its wall time is its own.

An engine runs with or without an offloading connector: `EngineJob.kv_transfer_config`
is the dict vLLM's `--kv-transfer-config` takes (None: vLLM's baseline engine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape: what `config.json` says; vLLM builds the model from it."""

    architecture: str  # "llama", "qwen2" or "gemma3" (Gemma 3's text model)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int = 8192
    # hybrid attention (gemma3 only): every `full_every`-th layer attends to the whole
    # context, the others to the last `sliding_window` tokens; vLLM makes one KV-cache
    # group per set of layers of one kind
    sliding_window: int | None = None
    full_every: int = 6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_types(self) -> list[str]:
        return [
            "full_attention" if (i + 1) % self.full_every == 0 else "sliding_attention"
            for i in range(self.layers)
        ]

    def kv_bytes(self, tokens: int, itemsize: int = 4) -> int:
        """Bytes of K and V for `tokens` tokens over all layers."""
        return self.layers * 2 * tokens * self.kv_heads * self.head_dim * itemsize


# The engine tests' model: small enough that a prompt takes milliseconds.
TINY = ModelShape("llama", layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=1024)
# The 0.5B-shaped model (Qwen2-0.5B's layers, hidden size and heads) for timings.
QWEN2_05B = ModelShape(
    "qwen2", layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab=32000
)

# A Gemma-3-shaped hybrid: five sliding-window layers to one full-attention layer, a
# window of two engine blocks (vLLM splits the six layers into six KV-cache groups).
TINY_HYBRID = ModelShape(
    "gemma3",
    layers=6,
    hidden=128,
    heads=4,
    kv_heads=2,
    intermediate=256,
    vocab=1024,
    sliding_window=64,
)
# The 0.5B-shaped model's hybrid variant (its 24 layers: 20 sliding, 4 full).
QWEN2_05B_HYBRID = ModelShape(
    "gemma3",
    layers=24,
    hidden=896,
    heads=14,
    kv_heads=2,
    intermediate=4864,
    vocab=32000,
    sliding_window=512,
)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def write_model(directory: Path, shape: ModelShape, *, weights: bool, seed: int = 0) -> Path:
    """A model directory vLLM loads without downloading anything.

    `weights=False` writes only `config.json`, for `load_format="dummy"`: vLLM fills the
    weights with uniform noise in +-1e-3, so every token gets nearly the same logit and
    what a model computes from its KV barely shows in its output (fine for timings).
    `weights=True` also writes seeded Gaussian weights (`load_format="safetensors"`)
    scaled so that attention over the prompt decides the next token: a wrong KV block
    changes tokens and logprobs, which is what the equivalence tests must be able to see.
    """
    if shape.architecture not in _ARCHITECTURES:
        raise ValueError(f"architecture {shape.architecture!r}; known: {sorted(_ARCHITECTURES)}")
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [_ARCHITECTURES[shape.architecture]],
        "model_type": shape.architecture,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if shape.architecture == "gemma3":
        config |= {
            "model_type": "gemma3_text",
            "head_dim": shape.head_dim,
            "query_pre_attn_scalar": shape.head_dim,
            "sliding_window": shape.sliding_window or shape.max_positions,
            "layer_types": shape.layer_types,
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
        }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if weights:
        _write_weights(directory / "model.safetensors", shape, seed)
    return directory


def _write_weights(path: Path, shape: ModelShape, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * (gain / cols**0.5)

    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    gemma = shape.architecture == "gemma3"
    # Gemma's norms scale by 1 + weight; the others by weight
    norm = torch.zeros if gemma else torch.ones
    tensors = {
        "model.embed_tokens.weight": torch.randn(shape.vocab, shape.hidden, generator=gen),
        "model.norm.weight": norm(shape.hidden),
    }
    if gemma:  # tied to the output; the input is scaled up by sqrt(hidden), so the
        # embedding would drown what attention adds to the residual (every prompt would
        # repeat its last token): small embeddings, attention outputs scaled by 4 (below)
        tensors["model.embed_tokens.weight"] *= 2 / shape.hidden**0.5
    else:
        tensors["lm_head.weight"] = linear(shape.vocab, shape.hidden, gain=3.0)  # peaked
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "input_layernorm.weight": norm(shape.hidden),
            prefix + "post_attention_layernorm.weight": norm(shape.hidden) + 3 * gemma,
            prefix + "self_attn.q_proj.weight": linear(q_rows, shape.hidden),
            prefix + "self_attn.k_proj.weight": linear(kv_rows, shape.hidden),
            prefix + "self_attn.v_proj.weight": linear(kv_rows, shape.hidden),
            prefix + "self_attn.o_proj.weight": linear(shape.hidden, q_rows),
            prefix + "mlp.gate_proj.weight": linear(shape.intermediate, shape.hidden),
            prefix + "mlp.up_proj.weight": linear(shape.intermediate, shape.hidden),
            prefix + "mlp.down_proj.weight": linear(shape.hidden, shape.intermediate),
        }
        if gemma:  # norms of q and k per head, and around the MLP
            tensors |= {
                prefix + "self_attn.q_norm.weight": norm(shape.head_dim),
                prefix + "self_attn.k_norm.weight": norm(shape.head_dim),
                prefix + "pre_feedforward_layernorm.weight": norm(shape.hidden),
                prefix + "post_feedforward_layernorm.weight": norm(shape.hidden),
            }
        if shape.architecture == "qwen2":  # Qwen2 has biases on q, k and v
            for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                tensors[prefix + f"self_attn.{name}_proj.bias"] = torch.zeros(rows)
    save_file(tensors, str(path))


@dataclass(frozen=True)
class Round:
    """Prompts served one after the other, each alone, greedy."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int = 4
    logprobs: int = 2
    name: str = ""
    # faults injected before the round, while the engine runs: ("kill", PID) sends
    # SIGKILL to a process (a Redis server), ("corrupt", GLOB) flips the last byte of
    # every file matching GLOB (disk block files)
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


def tensor_parallel_env(workers: int) -> dict[str, str]:
    """The CPU build's thread binding for `workers` workers: one core each (wrapping
    around when the machine has fewer cores than workers)."""
    cores = os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % cores) for i in range(workers))}


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


def run_job(job: EngineJob, *, timeout_s: float = 900, workdir: Path | None = None) -> JobResult:
    """Start an engine in a child process, serve the job, return what it produced.

    The child and every process vLLM spawns share a new session, which is killed on a
    timeout, so no engine outlives the call.
    """
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-", dir=workdir) as tmp:
        job_path, out_path, log_path = (Path(tmp) / n for n in ("job.json", "out.json", "log"))
        job_path.write_text(json.dumps(job.to_json()))
        env = {**os.environ, "PYTHONPATH": _pythonpath()}
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.vllm.engine_run", str(job_path), str(out_path)],
                cwd=REPO_ROOT,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
        log = log_path.read_text(errors="replace")
        if code != 0 or not out_path.exists():
            why = "timed out" if code is None else f"exited with {code}"
            raise RuntimeError(f"engine job {why}; its log ends:\n{log[-6000:]}")
        names = tuple(r.name for r in job.rounds)
        return JobResult.from_json(json.loads(out_path.read_text()), log, names)


def _pythonpath() -> str:
    """The child imports this checkout's kvtier and tests, whatever the caller's cwd."""
    parts = [str(REPO_ROOT / "src"), str(REPO_ROOT)]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)
