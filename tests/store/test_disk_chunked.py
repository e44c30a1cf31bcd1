"""Disk loads of big blocks into many segments: every part lands and is verified.

Loads read a block with `readv`s straight into its segments and hash each chunk as it
lands; these tests put corruption and truncation in the last part, the one a wrong split
would skip, and use segment lists of both engine layouts.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from kvtier.store.disk_store import DiskStore
from kvtier.store.diskformat import (
    BlockHeader,
    FormatError,
    HeaderCheck,
    file_name,
    payload_checksum,
    read_into,
)
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError
from kvtier.types import int_block_hash

# 4 layers x K/V x 64 KiB planes: 512 KiB blocks; cross-layer: one 512 KiB row.
PER_LAYER = KVLayout(num_layers=4, num_kv_heads=8, head_size=128, block_size=32)
CROSS = KVLayout(num_layers=4, num_kv_heads=8, head_size=128, block_size=32, per_layer=False)


def blocks_of(layout: KVLayout, data: bytearray) -> list[memoryview]:
    """`data` cut into the layout's segments, in order (what the transfer handler passes)."""
    view, size = memoryview(data), layout.segment_bytes
    return [view[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("layout", [PER_LAYER, CROSS], ids=["per_layer", "cross_layer"])
def test_big_blocks_round_trip_through_their_segments(tmp_path: Path, layout: KVLayout) -> None:
    store = DiskStore(tmp_path, layout, DiskStore.capacity_for(layout, 3), fsync=False)
    payloads = [random.Random(i).randbytes(layout.bytes_per_block) for i in range(3)]
    hashes = [int_block_hash(i) for i in range(3)]
    store.write(hashes, payloads)
    targets = [bytearray(layout.bytes_per_block) for _ in range(3)]
    store.read_parts(hashes, [blocks_of(layout, t) for t in targets])
    assert [bytes(t) for t in targets] == payloads
    whole = bytearray(layout.bytes_per_block)  # and as one row, whatever the layout
    store.read([hashes[1]], [memoryview(whole)])
    assert bytes(whole) == payloads[1]


@pytest.mark.parametrize("layout", [PER_LAYER, CROSS], ids=["per_layer", "cross_layer"])
@pytest.mark.parametrize("damage", ["flip_last_byte", "truncate_last_chunk"])
def test_damage_in_the_last_chunk_fails_the_load(
    tmp_path: Path, layout: KVLayout, damage: str
) -> None:
    store = DiskStore(tmp_path, layout, DiskStore.capacity_for(layout, 2), fsync=False)
    hashes = [int_block_hash(0), int_block_hash(1)]
    payload = random.Random(7).randbytes(layout.bytes_per_block)
    store.write(hashes, [payload, payload])
    path = store.directory / file_name(hashes[0])
    data = bytearray(path.read_bytes())
    if damage == "flip_last_byte":
        data[-1] ^= 0x40
    else:
        del data[-100:]
    path.write_bytes(bytes(data))
    target = bytearray(layout.bytes_per_block)
    with pytest.raises(BlockLoadError, match="dropped"):
        store.read_parts([hashes[0]], [blocks_of(layout, target)])
    assert hashes[0] not in store and store.take_dropped() == [hashes[0]]
    assert store.stats().checksum_failures == 1
    store.read_parts([hashes[1]], [blocks_of(layout, target)])  # the intact one still loads
    assert bytes(target) == payload


def test_parts_of_other_formats_are_sized_in_bytes(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, CROSS, DiskStore.capacity_for(CROSS, 1), fsync=False)
    payload = random.Random(3).randbytes(CROSS.bytes_per_block)
    store.write([int_block_hash(0)], [payload])
    target = bytearray(CROSS.bytes_per_block)
    halves = memoryview(target).cast("H")  # float16-like elements: len is not the size
    store.read_parts([int_block_hash(0)], [[halves]])
    assert bytes(target) == payload
    with pytest.raises(ValueError, match="layout needs"):
        store.read_parts([int_block_hash(0)], [[halves[:-1]]])


def test_the_fast_header_check_agrees_with_the_full_one() -> None:
    block_hash = int_block_hash(42)
    fingerprint = CROSS.fingerprint_bytes
    header = bytearray(BlockHeader(block_hash, fingerprint, 1000, 0xABCDEF).pack())
    check = HeaderCheck(fingerprint, 1000)
    assert check.payload_checksum(header, block_hash) == 0xABCDEF
    assert payload_checksum(header, block_hash, fingerprint, 1000) == 0xABCDEF
    for position in range(len(header)):  # any flipped bit anywhere is refused by both
        damaged = bytearray(header)
        damaged[position] ^= 0x10
        with pytest.raises(FormatError):
            check.payload_checksum(damaged, block_hash)
    with pytest.raises(FormatError, match="another block"):
        check.payload_checksum(header, int_block_hash(43))
    with pytest.raises(FormatError, match="another layout"):
        HeaderCheck(PER_LAYER.fingerprint_bytes, 1000).payload_checksum(header, block_hash)
    with pytest.raises(FormatError, match="another layout or size"):
        HeaderCheck(fingerprint, 999).payload_checksum(header, block_hash)
    with pytest.raises(FormatError, match="header of"):
        check.payload_checksum(header[:-1], block_hash)


def test_read_into_more_parts_than_one_readv_takes_and_a_short_file(tmp_path: Path) -> None:
    data = random.Random(5).randbytes(1100 * 4)
    path = tmp_path / "f"
    path.write_bytes(data)
    target = bytearray(len(data) + 8)
    views = [memoryview(target)[i : i + 4] for i in range(0, len(target), 4)]  # 1102 parts
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_into(fd, views, len(target)) == len(data)  # past IOV_MAX, then EOF
    finally:
        os.close(fd)
    assert bytes(target[: len(data)]) == data
