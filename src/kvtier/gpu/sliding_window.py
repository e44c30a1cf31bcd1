"""Sliding-window attention: which blocks a hit needs, and which a request can drop.

With a window of W tokens, a token attends only to the W - 1 tokens before it. So a
prefix hit at block i is usable when the blocks covering the last W - 1 tokens before
the hit point are cached (earlier ones may be gone), and during decode the blocks that
lie entirely before the window of the next token can be released.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.gpu.block import KVCacheBlock
from kvtier.types import BlockHash


def num_window_blocks(sliding_window: int, block_size: int) -> int:
    """Contiguous cached blocks a hit needs: those covering W - 1 tokens."""
    return -(-(sliding_window - 1) // block_size)


def find_sliding_window_hit(
    lookup: Callable[[BlockHash], KVCacheBlock | None],
    block_hashes: Sequence[BlockHash],
    max_num_blocks: int,
    num_contiguous: int,
    null_block: KVCacheBlock,
) -> list[KVCacheBlock]:
    """The longest usable hit, with `null_block` standing for blocks it does not need.

    Searches right to left (vLLM's order) and stops at the first run of
    `num_contiguous` cached blocks; a shorter run that starts at block 0 is a hit too.
    """
    computed = [null_block] * max_num_blocks
    run = 0
    for i in range(max_num_blocks - 1, -1, -1):
        block = lookup(block_hashes[i])
        if block is None:
            run = 0
            continue
        computed[i] = block
        run += 1
        if run >= num_contiguous:
            del computed[i + run :]
            return computed
    del computed[run:]
    return computed


def skipped_block_indices(
    blocks: Sequence[KVCacheBlock], num_computed_tokens: int, sliding_window: int, block_size: int
) -> list[int]:
    """Indices (last first) of blocks entirely before the window of the next token.

    Stops at the first null block: everything before it was released earlier.
    """
    first_useful_block = (num_computed_tokens - sliding_window + 1) // block_size
    indices: list[int] = []
    for i in range(min(first_useful_block, len(blocks)) - 1, -1, -1):
        if blocks[i].is_null:
            break
        indices.append(i)
    return indices
