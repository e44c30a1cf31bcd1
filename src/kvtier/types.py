"""Identities shared by every layer.

A block hash is opaque bytes (32 for sha256, 16 for xxh3_128; traces that carry
integer ids are packed to 8 bytes). A NewType keeps a hash from being confused
with token ids or slot ids at type-check time, at no run-time cost.
"""

from __future__ import annotations

from typing import NewType

BlockHash = NewType("BlockHash", bytes)


# Trace hash ids are packed into 8 bytes: the ids a trace may carry are [0, 2**64).
MAX_INT_BLOCK_HASH = (1 << 64) - 1


def int_block_hash(value: int) -> BlockHash:
    """Pack a trace's integer hash id as a block hash (8 bytes, big-endian)."""
    if not 0 <= value <= MAX_INT_BLOCK_HASH:
        raise ValueError(f"trace hash id must be in [0, 2**64), got {value}")
    return BlockHash(value.to_bytes(8, "big"))
