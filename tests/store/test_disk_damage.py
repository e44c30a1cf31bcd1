"""A damaged disk tier directory is refused or dropped with the path named, never a raw
error, and a block is either served both while open and after a restart or neither
(issue 15 item 11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.store.disk_store import DiskStore
from kvtier.store.diskformat import LAYOUT_FILE, FormatError, file_name
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError
from kvtier.types import int_block_hash

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_size=8, block_size=4, dtype="float16")
OTHER = KVLayout(num_layers=3, num_kv_heads=1, head_size=8, block_size=4, dtype="float16")
SIZE = LAYOUT.bytes_per_block


def filled(root: Path, layout: KVLayout = LAYOUT, **kwargs: object) -> DiskStore:
    store = DiskStore(root, layout, DiskStore.capacity_for(layout, 8), **kwargs)  # type: ignore[arg-type]
    store.write(
        [int_block_hash(i) for i in range(3)],
        [bytes([i]) * layout.bytes_per_block for i in range(3)],
    )
    return store


def snapshot(directory: Path) -> dict[str, bytes | None]:
    return {p.name: p.read_bytes() if p.is_file() else None for p in directory.iterdir()}


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        (b'{"fingerprint": "ab', "layout marker is not valid JSON"),
        (
            b"[1, 2]",
            "layout marker must be a JSON object with a 'fingerprint' string, got '\\[1, 2\\]'",
        ),
        (b'{"fingerprint": 7}', "layout marker must be a JSON object with a 'fingerprint' string"),
        (b"\xff\xfe", "layout marker is not valid JSON"),
    ],
)
def test_a_damaged_layout_marker_is_refused_naming_it(
    tmp_path: Path, marker: bytes, message: str
) -> None:
    store = filled(tmp_path)
    store.close()
    path = store.directory / LAYOUT_FILE
    path.write_bytes(marker)
    before = snapshot(store.directory)
    with pytest.raises(FormatError, match=f"{path}: {message}"):
        filled(tmp_path)
    assert snapshot(store.directory) == before  # no block deleted, marker as it was


def test_a_block_replaced_by_a_directory(tmp_path: Path) -> None:
    store = filled(tmp_path)
    path = store.directory / file_name(int_block_hash(1))
    path.unlink()
    path.mkdir()
    with pytest.raises(BlockLoadError, match=f"cannot read {path} \\(Is a directory\\)"):
        store.read([int_block_hash(1)], [memoryview(bytearray(SIZE))])
    assert int_block_hash(1) not in store
    store.close()
    before = snapshot(store.directory)
    with pytest.raises(FormatError, match=f"{path}: a block file's name, but not a regular"):
        filled(tmp_path)
    assert snapshot(store.directory) == before


def test_a_block_with_bytes_appended_is_refused_open_and_at_restart(tmp_path: Path) -> None:
    store = filled(tmp_path)
    path = store.directory / file_name(int_block_hash(1))
    with path.open("ab") as f:
        f.write(b"x")
    with pytest.raises(BlockLoadError, match="longer than one block"):
        store.read([int_block_hash(1)], [memoryview(bytearray(SIZE))])
    assert not path.exists() and store.stats().checksum_failures == 1
    target = bytearray(SIZE)
    store.read([int_block_hash(2)], [memoryview(target)])  # the others still load
    assert target == bytes([2]) * SIZE
    store.close()
    again = DiskStore(tmp_path, LAYOUT, DiskStore.capacity_for(LAYOUT, 8))
    assert sorted(again.recovered) == [int_block_hash(0), int_block_hash(2)]
    again.close()


def test_another_layout_opened_with_ignore_leaves_the_original_openable(tmp_path: Path) -> None:
    filled(tmp_path).close()
    filled(tmp_path, OTHER, on_mismatch="ignore").close()
    store = filled(tmp_path)  # strict open: the other layout shares the root by consent
    assert len(store.recovered) == 3
    store.close()
