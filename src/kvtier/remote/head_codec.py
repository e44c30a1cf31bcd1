"""The envelope of a value that holds a group of KV heads of one block (`head_keys`).

A tensor-parallel worker writes its heads of a block as one value, so an engine reading
its own layout's blocks makes one GET per block, as with one value per block. An
engine of another layout reads only some heads of such a value (Redis GETRANGE), so
each head carries its own checksum: any run of heads can be verified without the rest.

Layout (little-endian, 40 + 8 x heads bytes; 48, as `codec`'s header, for one head):
    magic "KVTR" | format u16 (2) | heads u16 | fingerprint digest 16 bytes |
    block-hash digest u64 | bytes per head u64 | each head's xxh3-64, u64 each

The fingerprint digest names the layout and the group (its first head and count), so a
value answers only for its own group's key, and the first 32 bytes (everything up to
the block-hash digest) are what a lookup compares, as for `codec`'s values.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.remote.codec import MAGIC, BlockCodec, DecodeStatus, block_digest, fingerprint_digest
from kvtier.validate import positive_int

GROUP_FORMAT = 2
_FIXED = struct.Struct("<4sHH16sQQ")  # 40 bytes: all but the heads' checksums
_PREFIX = struct.Struct("<4sHH16sQ")  # the 32 bytes a lookup compares


@dataclass(frozen=True)
class HeadGroup:
    """KV heads `first` .. `first + count - 1` of a block: what one value holds."""

    first: int
    count: int

    def __post_init__(self) -> None:
        positive_int("HeadGroup.count", self.count)
        if self.first < 0:
            raise ValueError(f"HeadGroup.first must be >= 0, got {self.first}")

    @property
    def heads(self) -> range:
        return range(self.first, self.first + self.count)

    @property
    def end(self) -> int:
        return self.first + self.count


def header_size(heads: int) -> int:
    """The header of a value of `heads` heads."""
    return _FIXED.size + 8 * heads


def grouping(total: int, size: int) -> list[HeadGroup]:
    """The groups of `size` heads an engine whose workers hold `size` heads each writes."""
    return [HeadGroup(first, size) for first in range(0, total, size)]


def group_sizes(total: int, own: int) -> list[int]:
    """Every grouping of `total` heads, by heads a group: `own` (this engine's) first,
    then the others, fewest groups first (the order readers try them in)."""
    others = [s for s in range(total, 0, -1) if total % s == 0 and s != own]
    return [own, *others]


@dataclass(frozen=True)
class GroupCodec(BlockCodec):
    """Encodes and verifies the values of one head group under one layout fingerprint."""

    group: HeadGroup

    @classmethod
    def for_group(cls, fingerprint: str | bytes, group: HeadGroup) -> GroupCodec:
        raw = fingerprint.encode() if isinstance(fingerprint, str) else bytes(fingerprint)
        named = raw + b"#heads%d+%d" % (group.first, group.count)
        return cls(fingerprint_digest(named), group)

    @property
    def header_size(self) -> int:
        return header_size(self.group.count)

    def header(self, block_hash: bytes, payload: bytes | bytearray | memoryview) -> bytes:
        view = memoryview(payload).cast("B")
        count = self.group.count
        if len(view) % count:
            raise ValueError(f"a value of {len(view)} bytes does not cut into {count} heads")
        size = len(view) // count
        sums = [xxhash.xxh3_64_intdigest(view[i * size : (i + 1) * size]) for i in range(count)]
        return self.header_for(block_hash, size, sums)

    def header_of(self, block_hash: bytes, pieces: Sequence[memoryview]) -> bytes:
        """(A head group's values come whole: pieces are joined first.)"""
        payload = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        return self.header(block_hash, payload)

    def header_for(self, block_hash: bytes, head_bytes: int, sums: Sequence[int]) -> bytes:
        """The header of a value whose heads (`head_bytes` each) have checksums `sums`."""
        count = self.group.count
        if len(sums) != count:
            raise ValueError(f"{len(sums)} checksums for a group of {count} heads")
        fixed = _FIXED.pack(
            MAGIC, GROUP_FORMAT, count, self.fp_digest, block_digest(block_hash), head_bytes
        )
        return fixed + struct.pack(f"<{count}Q", *sums)

    def format_fields(self) -> tuple[int, int]:
        return GROUP_FORMAT, self.group.count

    @property
    def min_prefix(self) -> int:
        return _PREFIX.size

    def decode(self, block_hash: bytes, value: bytes) -> tuple[DecodeStatus, memoryview | None]:
        size = self.header_size
        return self.verify_heads(block_hash, value[:size], memoryview(value)[size:], self.group)

    def verify_heads(
        self, block_hash: bytes, header: bytes, part: memoryview, heads: HeadGroup
    ) -> tuple[DecodeStatus, memoryview | None]:
        """`part` (the bytes of `heads`, a run of this group's heads, read on their own)
        if the header is this group's and each head's checksum matches, else why not."""
        status, size, sums = self.head_sums(block_hash, header)
        if status is not DecodeStatus.OK:
            return status, None
        group = self.group
        if not group.first <= heads.first < heads.end <= group.end:
            return DecodeStatus.CORRUPT, None
        if len(part) != heads.count * size:
            return DecodeStatus.CORRUPT, None
        for i, head in enumerate(heads.heads):
            checksum = xxhash.xxh3_64_intdigest(part[i * size : (i + 1) * size])
            if checksum != sums[head - group.first]:
                return DecodeStatus.CORRUPT, None
        return DecodeStatus.OK, part

    def head_sums(
        self, block_hash: bytes, header: bytes
    ) -> tuple[DecodeStatus, int, tuple[int, ...]]:
        """A header's bytes per head and each head's checksum (indexed from the group's
        first head), if it is this group's header for `block_hash`, else why not."""
        status = self.check_prefix(block_hash, header)
        if status is DecodeStatus.OK and len(header) != self.header_size:
            status = DecodeStatus.CORRUPT
        if status is not DecodeStatus.OK:
            return status, 0, ()
        size = _FIXED.unpack_from(header)[-1]
        return status, size, struct.unpack_from(f"<{self.group.count}Q", header, _FIXED.size)
