"""A tensor-parallel worker's shard: its own heads of every block, moved alone.

Each worker of a tensor-parallel engine holds the KV of its heads only, as vLLM
registers them (pages of `[K plane][V plane]`, each `[tokens, its heads, head dim]`),
and moves them to tiers of its own. Built here from one full cache on one device: the
two ranks' stored blocks are exactly the full block's heads, split; a rank's job moves
its bytes only; and loading both shards back reassembles the full block.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.store.layout import KVLayout
from kvtier.transfer.pages import PagedDeviceKV
from tests.gpu.kit import BASE, Tier, block_bytes, run_jobs

TP = 2


def _shard_pages(full: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s pages from full per-layer caches `[2, blocks, tokens, heads, dim]`."""
    per_rank = BASE.num_kv_heads // TP
    heads = slice(rank * per_rank, (rank + 1) * per_rank)
    pages = []
    for layer in full:
        k, v = layer[0, :, :, heads], layer[1, :, :, heads]
        blocks = layer.shape[1]
        page = torch.cat([k.reshape(blocks, -1), v.reshape(blocks, -1)], dim=1)
        pages.append(page.contiguous().view(torch.uint8).view(torch.int8))
    return pages


def _shard_layout(rank: int) -> KVLayout:
    plane = BASE.block_size * (BASE.num_kv_heads // TP) * BASE.head_size * BASE.itemsize
    return KVLayout(
        BASE.num_layers,
        1,
        plane // BASE.block_size,
        BASE.block_size,
        "uint8",
        model_id=f"rank {rank}",
    )


def _expected(full: list[torch.Tensor], block: int, ranks: range) -> bytes:
    """The block's bytes of `ranks`' heads in host order [layer][K, V][token][head][dim]."""
    per_rank = BASE.num_kv_heads // TP
    heads = slice(ranks.start * per_rank, ranks.stop * per_rank)
    return b"".join(
        layer[kv, block, :, heads].contiguous().cpu().view(torch.uint8).numpy().tobytes()
        for layer in full
        for kv in (0, 1)
    )


@pytest.mark.parametrize("tier_name", ["cpu", "disk"])
def test_each_rank_moves_its_own_heads_alone(
    device: torch.device, tier_name: str, tmp_path: Path
) -> None:
    generator = torch.Generator().manual_seed(5)
    shape = (2, 16, BASE.block_size, BASE.num_kv_heads, BASE.head_size)
    full = [
        torch.randn(shape, generator=generator).to(torch.bfloat16).to(device)
        for _ in range(BASE.num_layers)
    ]
    ranks = [PagedDeviceKV(_shard_layout(r), _shard_pages(full, r)) for r in range(TP)]
    tiers = [Tier(tier_name, kv, tmp_path / f"rank{r}", num_blocks=8) for r, kv in enumerate(ranks)]
    try:
        rank0_before = [block_bytes(ranks[0], b) for b in range(16)]
        # rank 1 stores blocks 2-5 alone: its heads, half of each block's bytes
        (result,) = run_jobs(tiers[1].worker, [("store", 0, range(2, 6), tiers[1].spec(range(4)))])
        assert result.bytes == 4 * BASE.bytes_per_block // TP
        for slot, block in enumerate(range(2, 6)):
            assert tiers[1].stored_bytes(slot) == _expected(full, block, range(1, 2))
        assert [block_bytes(ranks[0], b) for b in range(16)] == rank0_before
        # rank 0 too; then each loads its shard into blocks 10-13, and together they
        # hold the full blocks again
        run_jobs(tiers[0].worker, [("store", 0, range(2, 6), tiers[0].spec(range(4)))])
        for r in range(TP):
            run_jobs(tiers[r].worker, [("load", 1, range(10, 14), tiers[r].spec(range(4)))])
        for block, source in zip(range(10, 14), range(2, 6), strict=True):
            for r in range(TP):
                assert block_bytes(ranks[r], block) == _expected(full, source, range(r, r + 1))
    finally:
        for tier in tiers:
            tier.close()
