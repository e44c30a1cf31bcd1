"""The fixed binary envelope of a block value in the remote store.

Anything read back from a shared server is untrusted: another engine, an older
kvtier, a bit flip or an operator's `SET` may have put it there. So a value is
raw block bytes behind a fixed 48-byte header that is parsed with `struct`
only (nothing is ever unpickled or evaluated), and a value is served only when
every field agrees: magic, format version, layout fingerprint, the block hash it
was written for (a value copied under the wrong key is refused) and an xxh3-64
checksum of the payload.

Layout (little-endian, 48 bytes):
    magic "KVTR" | format u16 | header length u16 | fingerprint digest 16 bytes |
    block-hash digest u64 | payload length u64 | payload xxh3-64 u64
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.store.checksum import segments_checksum

MAGIC = b"KVTR"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHH16sQQQ")
HEADER_SIZE = _HEADER.size  # 48
_PREFIX = struct.Struct("<4sHH16sQ")  # the fields a lookup can check without the payload


class DecodeStatus(enum.Enum):
    """Why a value was (not) served; each refusal is counted separately."""

    OK = "ok"
    MALFORMED = "malformed"  # not our envelope at all, or another format version
    FOREIGN = "foreign"  # written for another layout fingerprint: ignored, never misread
    WRONG_KEY = "wrong_key"  # a valid value stored under another block's key
    CORRUPT = "corrupt"  # truncated, or the payload checksum does not match


def fingerprint_digest(fingerprint: str | bytes) -> bytes:
    """16 bytes that identify a layout fingerprint in every header and key."""
    raw = fingerprint.encode() if isinstance(fingerprint, str) else bytes(fingerprint)
    if not raw:
        raise ValueError("layout fingerprint must be non-empty")
    return xxhash.xxh3_128_digest(raw)


def block_digest(block_hash: bytes) -> int:
    """A 64-bit digest of the block hash, so a value answers only for its own key."""
    return xxhash.xxh3_64_intdigest(block_hash)


@dataclass(frozen=True)
class BlockCodec:
    """Encodes and verifies values for one layout fingerprint."""

    fp_digest: bytes

    @classmethod
    def for_fingerprint(cls, fingerprint: str | bytes) -> BlockCodec:
        return cls(fingerprint_digest(fingerprint))

    @property
    def header_size(self) -> int:
        """Bytes before the payload in every value of this codec."""
        return HEADER_SIZE

    def header(self, block_hash: bytes, payload: bytes | bytearray | memoryview) -> bytes:
        """The 48-byte header for `payload` stored under `block_hash`."""
        return self._pack(block_hash, len(payload), xxhash.xxh3_64_intdigest(payload))

    def header_of(self, block_hash: bytes, pieces: Sequence[memoryview]) -> bytes:
        """The header of the payload that is `pieces` end to end (a CPU slot's segments),
        without joining them."""
        if len(pieces) == 1:
            return self.header(block_hash, pieces[0])
        size = sum(len(piece) for piece in pieces)
        return self._pack(block_hash, size, segments_checksum(pieces))

    def _pack(self, block_hash: bytes, size: int, checksum: int) -> bytes:
        fields = (self.fp_digest, block_digest(block_hash), size, checksum)
        return _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, *fields)

    def encode(self, block_hash: bytes, payload: bytes | bytearray | memoryview) -> bytes:
        """Header and payload in one new value (one copy of the payload)."""
        return b"".join((self.header(block_hash, payload), payload))

    def encode_into(
        self, buffer: bytearray, block_hash: bytes, pieces: Sequence[memoryview]
    ) -> memoryview:
        """Header and payload (`pieces` end to end) in a reused buffer (at least the
        header and the payload long).

        Why: a fresh multi-MiB value per block costs page faults that dwarf the
        copy itself; a warm buffer makes the envelope nearly free.
        """
        header_size = self.header_size
        size = header_size + sum(len(piece) for piece in pieces)
        if len(buffer) < size:
            raise ValueError(f"buffer of {len(buffer)} bytes cannot hold {size}")
        view = memoryview(buffer)[:size]
        view[:header_size] = self.header_of(block_hash, pieces)
        at = header_size
        for piece in pieces:
            view[at : at + len(piece)] = piece
            at += len(piece)
        return view

    def format_fields(self) -> tuple[int, int]:
        """The format version and the header's third field: its length here (a head
        group's values, `head_codec`, put their head count there)."""
        return FORMAT_VERSION, HEADER_SIZE

    @property
    def min_prefix(self) -> int:
        """The fewest header bytes `check_prefix` accepts."""
        return HEADER_SIZE

    def expected_prefix(self, block_hash: bytes) -> bytes:
        """The first 32 header bytes a valid value for `block_hash` must start with.

        A server-side lookup compares against these, so it needs no checksum and
        no knowledge of the format beyond "these bytes, exactly".
        """
        return _PREFIX.pack(MAGIC, *self.format_fields(), self.fp_digest, block_digest(block_hash))

    def check_prefix(self, block_hash: bytes, prefix: bytes | None) -> DecodeStatus:
        """Verify what a lookup fetched (the header only): all but the checksum."""
        if prefix is None or len(prefix) < self.min_prefix:
            return DecodeStatus.MALFORMED
        magic, version, third, fp, key = _PREFIX.unpack_from(prefix)
        if magic != MAGIC or (version, third) != self.format_fields():
            return DecodeStatus.MALFORMED
        if fp != self.fp_digest:
            return DecodeStatus.FOREIGN
        if key != block_digest(block_hash):
            return DecodeStatus.WRONG_KEY
        return DecodeStatus.OK

    def decode(self, block_hash: bytes, value: bytes) -> tuple[DecodeStatus, memoryview | None]:
        """The verified payload as a zero-copy view of `value`, or why it is refused."""
        status = self.check_prefix(block_hash, value)
        if status is not DecodeStatus.OK:
            return status, None
        length, checksum = struct.unpack_from("<QQ", value, HEADER_SIZE - 16)
        payload = memoryview(value)[HEADER_SIZE:]
        if len(payload) != length or xxhash.xxh3_64_intdigest(payload) != checksum:
            return DecodeStatus.CORRUPT, None
        return DecodeStatus.OK, payload
