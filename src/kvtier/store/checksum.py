"""Block checksums (xxh3-64): cheap enough to run on every store and every load.

xxh3 hashes at memory bandwidth, so verifying a block costs about one extra read of
it, far below the disk or network time it guards. A block is checksummed over its
segments in order, so a store never needs to gather a block just to hash it.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

Buffer = bytes | bytearray | memoryview


class ChecksumError(ValueError):
    """A block's bytes do not match the checksum written with them."""


def block_checksum(data: Buffer) -> int:
    """xxh3-64 of one contiguous block."""
    return int(xxhash.xxh3_64_intdigest(data))


def segments_checksum(segments: Iterable[Buffer]) -> int:
    """xxh3-64 of the concatenation of `segments`, without concatenating them."""
    if isinstance(segments, list | tuple) and len(segments) == 1:
        return int(xxhash.xxh3_64_intdigest(segments[0]))  # one-shot: no state object
    state = xxhash.xxh3_64()
    for segment in segments:
        state.update(segment)
    return int(state.intdigest())
