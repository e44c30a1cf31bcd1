"""Engines of several tensor-parallel sizes over one shared disk directory, for tests.

A model of `TOTAL` KV heads and `PAGES` layers; a block's bytes are `head_page(b, h, p)`
for head `h`'s part of layer `p`'s page, and a worker's row is its pages one after
the other, each page its heads one after the other (vLLM's head-major pages).
"""

from __future__ import annotations

import random
from pathlib import Path

from kvtier.remote.head_codec import HeadGroup, grouping
from kvtier.store.layout import KVLayout
from kvtier.store.shared_disk import SharedDiskStore
from kvtier.types import BlockHash, int_block_hash

TOTAL = 4
PAGES = 3
TOKENS = 2
HEAD_SIZE = 2  # bytes of one head of one token, K or V (uint8)
PIECE = 2 * TOKENS * HEAD_SIZE  # one head's part of one page
SHARED = KVLayout(PAGES, 1, HEAD_SIZE, TOKENS, dtype="uint8", model_id="test-heads")


def row_layout(count: int) -> KVLayout:
    """The row of a worker of `count` heads (what `engine_shape.layout_for` makes)."""
    return KVLayout(PAGES, 1, HEAD_SIZE * count, TOKENS, dtype="uint8", model_id=f"rank{count}")


def head_page(block: int, head: int, page: int) -> bytes:
    return random.Random(f"{block}/{head}/{page}").randbytes(PIECE)


def row(block: int, group: HeadGroup) -> bytes:
    return b"".join(head_page(block, h, p) for p in range(PAGES) for h in group.heads)


def engine(root: Path, size: int, blocks: int = 32, **kwargs: object) -> list[SharedDiskStore]:
    """The stores of an engine whose workers hold `size` heads each."""
    layout = row_layout(size)
    capacity = blocks * (40 + 8 * size + layout.bytes_per_block)
    return [
        SharedDiskStore(root, SHARED, layout, TOTAL, group, capacity, **kwargs)  # type: ignore[arg-type]
        for group in grouping(TOTAL, size)
    ]


def write(stores: list[SharedDiskStore], block: int) -> None:
    for store in stores:
        store.write([int_block_hash(block)], [row(block, store.group)])


def read(store: SharedDiskStore, block: int | BlockHash) -> bytes:
    buffer = bytearray(store.layout.bytes_per_block)
    key = int_block_hash(block) if isinstance(block, int) else block
    store.read([key], [memoryview(buffer)])
    return bytes(buffer)
