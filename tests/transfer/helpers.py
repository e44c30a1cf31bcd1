"""Shared fixtures for data-plane tests: small layouts, random caches, a dict-backed store."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError
from kvtier.transfer.device import DeviceKV, allocate_kv_caches
from kvtier.types import BlockHash

PER_LAYER = KVLayout(num_layers=3, num_kv_heads=2, head_size=4, block_size=4, dtype="float16")
CROSS_LAYER = KVLayout(
    num_layers=3, num_kv_heads=2, head_size=4, block_size=4, dtype="float16", per_layer=False
)
LAYOUTS = [PER_LAYER, CROSS_LAYER]


def random_kv(layout: KVLayout, num_blocks: int, seed: int) -> DeviceKV:
    """A CPU cache filled with seeded random values."""
    generator = torch.Generator().manual_seed(seed)
    caches = allocate_kv_caches(layout, num_blocks)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator, dtype=torch.float32))
    return DeviceKV(layout, caches)


def block_bytes(kv: DeviceKV, block_id: int) -> bytes:
    """One device block in host byte order, read independently of the copy code."""
    return b"".join(seg[block_id].numpy().tobytes() for seg in kv.segments)


class HashSpec(LoadStoreSpec):
    """A spec naming blocks by hash, as disk and remote stores use."""

    def __init__(self, block_hashes: Sequence[BlockHash]) -> None:
        self.block_hashes = list(block_hashes)

    @staticmethod
    def medium() -> str:
        return "TEST"


def hashes(*ids: int) -> HashSpec:
    return HashSpec([BlockHash(i.to_bytes(8, "big")) for i in ids])


class DictStore:
    """A `BlockStore` in a dict; fails writes/reads of hashes listed in `broken`."""

    def __init__(self, layout: KVLayout) -> None:
        self._layout = layout
        self.blocks: dict[bytes, bytes] = {}
        self.broken: set[bytes] = set()
        self._lock = threading.Lock()

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        assert isinstance(spec, HashSpec)
        if self.broken & set(spec.block_hashes):
            raise OSError("injected write failure")
        with self._lock:
            for key, block in zip(spec.block_hashes, blocks, strict=True):
                self.blocks[key] = bytes(block)

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        assert isinstance(spec, HashSpec)
        for key, block in zip(spec.block_hashes, blocks, strict=True):
            data = self.blocks.get(key)
            if data is None or key in self.broken:
                raise BlockLoadError(f"missing {key.hex()}")
            np.frombuffer(block, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
