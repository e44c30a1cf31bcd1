"""The model an engine of the harness loads: a shape written as `config.json`, nothing
downloaded (vLLM builds the model from it; dummy or seeded weights)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


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

    @property
    def kv_cache_groups(self) -> tuple[int, int]:
        """(full-attention, sliding-window) KV-cache groups vLLM 0.32 makes of the layers:
        each group has as many layers as the rarer kind (or the commoner, when it has
        fewer than 1.5 times as many), so that every group's block is one page size
        (`_get_kv_cache_groups_uniform_page_size`). The engine's pool is shared by them."""
        if self.sliding_window is None:
            return 1, 0
        full = self.layer_types.count("full_attention")
        sliding = self.layers - full
        if not full or not sliding:
            return int(full > 0), int(sliding > 0)
        size = min(full, sliding)
        if max(full, sliding) < 1.5 * size:
            size = max(full, sliding)
        return math.ceil(full / size), math.ceil(sliding / size)

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
        return torch.randn(rows, cols, generator=gen) * (gain / math.sqrt(cols))

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
