"""The value envelope: what is served, and every way a value is refused."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.remote.codec import HEADER_SIZE, BlockCodec, DecodeStatus, fingerprint_digest

CODEC = BlockCodec.for_fingerprint("model=m|dtype=bf16|block=16|v1")
OTHER = BlockCodec.for_fingerprint("model=m|dtype=fp8|block=16|v1")
HASH = b"\x01" * 32


def test_round_trip_is_zero_copy_view_of_the_value() -> None:
    value = CODEC.encode(HASH, b"kv-bytes")
    status, payload = CODEC.decode(HASH, value)
    assert status is DecodeStatus.OK and payload is not None
    assert bytes(payload) == b"kv-bytes"
    assert payload.obj is value  # no copy on the load path
    assert len(value) == HEADER_SIZE + 8


def test_header_is_fixed_48_bytes_little_endian() -> None:
    value = CODEC.encode(HASH, b"abc")
    magic, version, header_len = struct.unpack_from("<4sHH", value)
    assert (magic, version, header_len) == (b"KVTR", 1, 48)
    assert value[8:24] == fingerprint_digest("model=m|dtype=bf16|block=16|v1")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (OTHER.encode(HASH, b"abc"), DecodeStatus.FOREIGN),
        (CODEC.encode(b"\x02" * 32, b"abc"), DecodeStatus.WRONG_KEY),
        (b"\x80\x04\x95pickle" + b"\0" * 60, DecodeStatus.MALFORMED),
        (b"short", DecodeStatus.MALFORMED),
        (CODEC.encode(HASH, b"abc")[:-1], DecodeStatus.CORRUPT),
        (CODEC.encode(HASH, b"abc") + b"x", DecodeStatus.CORRUPT),
        (b"KVTR\x02\x00" + CODEC.encode(HASH, b"abc")[6:], DecodeStatus.MALFORMED),
    ],
    ids=["foreign", "wrong-key", "pickle", "short", "truncated", "extended", "version"],
)
def test_refusals(value: bytes, expected: DecodeStatus) -> None:
    assert CODEC.decode(HASH, value) == (expected, None)


def test_empty_fingerprint_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        fingerprint_digest(b"")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.data())
def test_any_single_byte_flip_is_refused(payload: bytes, data: st.DataObject) -> None:
    value = bytearray(CODEC.encode(HASH, payload))
    position = data.draw(st.integers(0, len(value) - 1))
    value[position] ^= data.draw(st.integers(1, 255))
    status, served = CODEC.decode(HASH, bytes(value))
    assert served is None and status is not DecodeStatus.OK


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300), st.binary(min_size=1, max_size=32))
def test_round_trip_any_payload_and_hash(payload: bytes, block_hash: bytes) -> None:
    status, served = CODEC.decode(block_hash, CODEC.encode(block_hash, payload))
    assert status is DecodeStatus.OK and served is not None and bytes(served) == payload


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=100), min_size=1, max_size=6), st.binary(min_size=1))
def test_a_payload_in_pieces_gets_the_header_and_value_of_it_whole(
    pieces: list[bytes], block_hash: bytes
) -> None:
    """A CPU slot's segments go to Redis as they lie: the envelope must not tell."""
    views = [memoryview(p) for p in pieces]
    whole = b"".join(pieces)
    assert CODEC.header_of(block_hash, views) == CODEC.header(block_hash, whole)
    buffer = bytearray(HEADER_SIZE + len(whole) + 7)  # a reused buffer may be longer
    assert bytes(CODEC.encode_into(buffer, block_hash, views)) == CODEC.encode(block_hash, whole)
    with pytest.raises(ValueError, match="cannot hold"):
        CODEC.encode_into(bytearray(HEADER_SIZE), block_hash, [*views, memoryview(b"x")])
