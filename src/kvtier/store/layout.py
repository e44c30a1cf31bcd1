"""The KV layout: how many bytes one block holds, and whether two caches may share blocks.

A block moved to another tier is only bytes; reading it back with a different model,
dtype or geometry would silently corrupt attention. Every store therefore records the
layout `fingerprint` next to its blocks and refuses (or ignores) blocks carrying
another one.

The host-side byte order of a block is the same for both engine layouts:
`[layer][K, V][token][kv head][head dim]`. The engine side differs:

- `per_layer=True` (vLLM's default, FlashAttention shape): one tensor per layer of
  shape `[2, num_blocks, block_size, num_kv_heads, head_size]`, so one block is
  `2 * num_layers` separate segments in device memory.
- `per_layer=False` (cross-layer contiguous): one tensor of shape
  `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`, so one block is
  one contiguous segment.

Segment order (`segment_bytes`, `num_segments`) is what the transfer workers use to
gather a block into one contiguous host row and scatter it back.

This module never imports torch: disk stores and crash-recovery tools use it too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

# Bumped whenever the host byte order of a block or the fingerprint fields change.
FORMAT_VERSION = 1

# Item sizes of the dtypes KV caches use; names are torch's (`torch.<name>`).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class LayoutMismatchError(ValueError):
    """Blocks written under one layout fingerprint were offered to another layout."""


@dataclass(frozen=True)
class KVLayout:
    """Geometry of a model's KV cache; see the module docstring for the byte order."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str = "float16"
    per_layer: bool = True
    model_id: str = ""
    hash_scheme: str = "sha256_cbor"
    format_version: int = field(default=FORMAT_VERSION)

    @classmethod
    def from_model_config(
        cls, config: dict[str, Any], block_size: int, dtype: str | None = None
    ) -> KVLayout:
        """The layout of a Hugging Face `config.json`'s KV cache (a decoder whose every
        layer has full attention heads: what vLLM allocates per token), in `dtype` or the
        config's own `torch_dtype`. A missing key is a KeyError naming it."""
        try:
            layers = int(config["num_hidden_layers"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_size = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        except KeyError as e:
            raise KeyError(f"model config has no {e.args[0]!r} (needed for its KV size)") from None
        name = dtype or str(config.get("torch_dtype") or "float16")
        if name not in DTYPE_ITEMSIZE:
            raise ValueError(f"KV dtype {name!r}; known: {sorted(DTYPE_ITEMSIZE)}")
        return cls(layers, kv_heads, head_size, block_size, dtype=name)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name} must be an int >= 1, got {value!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(
                f"KVLayout.dtype {self.dtype!r} is not supported; known: {sorted(DTYPE_ITEMSIZE)}"
            )

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def segment_bytes(self) -> int:
        """Bytes of one device segment of a block (one K or V plane, or the whole block)."""
        if self.per_layer:
            return self.block_size * self.num_kv_heads * self.head_size * self.itemsize
        return self.bytes_per_block

    @property
    def num_segments(self) -> int:
        return 2 * self.num_layers if self.per_layer else 1

    @property
    def bytes_per_block(self) -> int:
        plane = self.block_size * self.num_kv_heads * self.head_size * self.itemsize
        return 2 * self.num_layers * plane

    def describe(self) -> dict[str, Any]:
        """Every field that decides whether blocks are interchangeable (JSON-safe)."""
        return {
            "model_id": self.model_id,
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "block_size": self.block_size,
            "layout": "per_layer" if self.per_layer else "cross_layer",
            "hash_scheme": self.hash_scheme,
            "format_version": self.format_version,
        }

    @cached_property
    def fingerprint(self) -> str:
        """Stable across processes, machines and Python versions: 32 hex chars."""
        canonical = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    @property
    def fingerprint_bytes(self) -> bytes:
        """The fingerprint as 16 raw bytes, for fixed-size binary headers."""
        return bytes.fromhex(self.fingerprint)

    def check_compatible(self, fingerprint: str, where: str) -> None:
        """Raise `LayoutMismatchError` naming `where` unless `fingerprint` is ours."""
        if fingerprint != self.fingerprint:
            raise LayoutMismatchError(
                f"{where} holds KV blocks with layout fingerprint {fingerprint}, but this "
                f"cache's layout is {self.fingerprint} ({self.describe()}); refusing to mix "
                "incompatible blocks"
            )
