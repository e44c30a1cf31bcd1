"""The on-disk format of one block file, and its directory namespace.

A block file is `<hash hex>.kv`: a small header, then the block's bytes in layout
order. The header carries the layout fingerprint, the block hash, the payload length
and the payload's xxh3, and is itself checksummed, so a file can be validated at
recovery from its header alone (cheap) and its payload at load (where the bytes are
read anyway).

Files are written as `<name>.<pid>-<n>.tmp`, fsynced, renamed, and the directory is
fsynced; anything ending in `.tmp` is a store that never completed and is deleted at
recovery. Blocks of one layout live in `<root>/kvtier-<fingerprint>/`, so layouts
never share a file name space.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvtier.types import BlockHash

MAGIC = b"KVTB"
VERSION = 1
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
LAYOUT_FILE = "layout.json"
DIR_PREFIX = "kvtier-"

# magic, version, hash length, fingerprint, payload length, payload xxh3
_FIXED = struct.Struct("<4sHH16sQQ")
_CHECK = struct.Struct("<Q")


class FormatError(ValueError):
    """A block file whose header is torn, foreign or inconsistent."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    block_hash: BlockHash
    fingerprint: bytes
    payload_len: int
    checksum: int

    @staticmethod
    def size_for(hash_len: int) -> int:
        return _FIXED.size + hash_len + _CHECK.size

    def pack(self) -> bytes:
        fixed = _FIXED.pack(
            MAGIC,
            VERSION,
            len(self.block_hash),
            self.fingerprint,
            self.payload_len,
            self.checksum,
        )
        body = fixed + self.block_hash
        return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def unpack(cls, data: bytes) -> BlockHeader:
        """Parse and self-check a header; `FormatError` says what is wrong."""
        if len(data) < _FIXED.size:
            raise FormatError(f"header truncated at {len(data)} bytes")
        magic, version, hash_len, fingerprint, payload_len, checksum = _FIXED.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise FormatError(f"not a kvtier block file (magic {magic!r}, version {version})")
        end = _FIXED.size + hash_len
        if len(data) < end + _CHECK.size:
            raise FormatError(f"header truncated at {len(data)} bytes")
        (stored,) = _CHECK.unpack_from(data, end)
        if xxhash.xxh3_64_intdigest(data[:end]) != stored:
            raise FormatError("header checksum mismatch")
        return cls(BlockHash(bytes(data[_FIXED.size : end])), fingerprint, payload_len, checksum)


def file_name(block_hash: BlockHash) -> str:
    return block_hash.hex() + SUFFIX


def hash_of(name: str) -> BlockHash | None:
    """The block hash a final file name encodes, or None for any other file."""
    if not name.endswith(SUFFIX):
        return None
    try:
        return BlockHash(bytes.fromhex(name[: -len(SUFFIX)]))
    except ValueError:
        return None
