"""vLLM's own cache layout: one `[num_blocks, page_bytes]` tensor per attention layer.

vLLM's offloading connector hands a worker "canonical" caches: each layer's blocks as
pages laid one after another, a page holding the block's K plane then its V plane
(of this worker's heads, under tensor parallelism). kvtier's data plane cuts each
page into its two halves, so the host byte order `[layer][K, V][...]` and every tier
below stay the same for all engine layouts. Kept apart from `kvtier.vllm` (which
imports vLLM) so the CUDA data-plane tests run it on a machine without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvtier.store.layout import KVLayout
from kvtier.transfer.device import DeviceKV


class PagedDeviceKV(DeviceKV):
    """Paged caches as kvtier's per-block segments (a K and a V half per page)."""

    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], heads: int = 1) -> None:
        """`heads` > 1: each page cut into that many equal parts first (a head-major page's
        KV heads, see `kvtier.vllm.offloading.engine_shape.head_sharing`), and a block's
        segments ordered head by head: a host row is then the block's heads one after
        the other."""
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        if len(tensors) * heads != layout.num_layers:
            raise ValueError(
                f"vLLM registered {len(tensors)} KV cache tensors of {heads} head(s), the "
                f"layout expects {layout.num_layers} (one per attention layer of its largest "
                f"KV-cache group and head)"
            )
        if not layout.per_layer:
            raise ValueError("paged caches hold one page per layer: the layout must be per_layer")
        seg = layout.segment_bytes
        page = 2 * heads * seg
        num_blocks = int(tensors[0].shape[0])
        for t in tensors:
            if tuple(t.shape) != (num_blocks, page) or t.stride() != (page, 1):
                raise ValueError(
                    f"KV cache tensor of shape {tuple(t.shape)} strides {t.stride()}: kvtier "
                    f"needs [{num_blocks}, {page}] pages laid out one after another"
                )
            if t.device != tensors[0].device:
                raise ValueError(f"KV cache tensors on {t.device} and {tensors[0].device}")
        self.layout = layout
        self.caches = list(tensors)
        self.device = tensors[0].device
        self.num_blocks = num_blocks
        parts = [t.view(torch.uint8).view(num_blocks, 2 * heads, seg) for t in tensors]
        self.segments = [p[:, 2 * j + i] for j in range(heads) for p in parts for i in (0, 1)]
        self.is_cuda = self.device.type == "cuda"
        self.arrays: list[npt.NDArray[np.uint8]] = (
            [] if self.is_cuda else [seg.numpy() for seg in self.segments]
        )

    @property
    def torch_threads(self) -> int | None:
        """Threads for each of kvtier's copying threads' torch ops: on the CPU platform
        vLLM's OpenMP threads hold every core, so one (see `limit_torch_threads`)."""
        return None if self.is_cuda else 1


def allocate_pages(
    layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Zeroed paged caches as vLLM registers them (int8 `[num_blocks, page_bytes]`)."""
    page = 2 * layout.segment_bytes
    return [
        torch.zeros((num_blocks, page), dtype=torch.int8, device=device)
        for _ in range(layout.num_layers)
    ]
