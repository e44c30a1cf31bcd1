"""Opening a disk tier's directory: refusing another layout's blocks, writing the
layout marker, and the recovery scan that finds every complete block after a crash.

Kept apart from `DiskStore`'s reads and writes because it runs once, at open, and
is what a crash-recovery tool needs on its own. The scan trusts nothing but a block
file's header (fingerprint, hash = file name, length) and its size: payloads are
verified at load, where they are read anyway.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from kvtier.store.diskformat import (
    DIR_PREFIX,
    LAYOUT_FILE,
    TMP_SUFFIX,
    BlockHeader,
    FormatError,
    HeaderCheck,
    durable_write,
    hash_of,
    sync_directory,
)
from kvtier.store.layout import KVLayout, LayoutMismatchError
from kvtier.types import BlockHash


def check_foreign(root: Path, directory: Path, layout: KVLayout) -> None:
    """Raise `LayoutMismatchError` if `root` holds another layout's block directory."""
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(DIR_PREFIX) and entry.name != directory.name and entry.is_dir():
            try:
                theirs = json.loads((entry / LAYOUT_FILE).read_text())
            except (OSError, ValueError):
                theirs = {"fingerprint": entry.name[len(DIR_PREFIX) :]}
            raise LayoutMismatchError(
                f"{root} holds KV blocks of another layout ({theirs}) in {entry}; "
                f"this cache's layout is {layout.fingerprint} "
                f"({layout.describe()}). Use another directory, delete it, or "
                "open with on_mismatch='ignore' to leave it untouched"
            )


def open_directory(root: Path, directory: Path, layout: KVLayout, fsync: bool) -> None:
    """Create `directory` with its layout marker, or check the marker already there."""
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / LAYOUT_FILE
    if marker.exists():
        found = json.loads(marker.read_text()).get("fingerprint", "")
        layout.check_compatible(found, str(directory))
        return
    description = {"fingerprint": layout.fingerprint, **layout.describe()}
    data = json.dumps(description, sort_keys=True).encode()
    durable_write(str(marker), f"{marker}.{os.getpid()}{TMP_SUFFIX}", [data], fsync)
    if fsync:
        sync_directory(root)


def scan(
    directory: Path, header_check: HeaderCheck, file_bytes: Callable[[BlockHash], int]
) -> tuple[list[tuple[BlockHash, int]], int]:
    """Every complete block file in `directory` as (hash, file size), oldest first, and
    how many files were deleted: temp files of unfinished writes, and block files
    whose header is torn, foreign or of the wrong size."""
    found: list[tuple[int, BlockHash, int]] = []
    deleted = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.endswith(TMP_SUFFIX):
                deleted += delete(entry.path)
                continue
            block_hash = hash_of(entry.name)
            if block_hash is None:
                continue
            size = _valid_size(entry.path, block_hash, header_check)
            if size is None or size != file_bytes(block_hash):
                deleted += delete(entry.path)
            else:
                found.append((entry.stat().st_mtime_ns, block_hash, size))
    found.sort()
    return [(block_hash, size) for _, block_hash, size in found], deleted


def delete(path: str) -> int:
    """Unlink `path` (gone already is fine); 1, for counting."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return 1


def _valid_size(path: str, block_hash: BlockHash, header_check: HeaderCheck) -> int | None:
    """The file's size if its header is intact and ours, else None."""
    try:
        with open(path, "rb") as file:
            raw_header = file.read(BlockHeader.size_for(len(block_hash)))
            header_check.payload_checksum(raw_header, block_hash)
            return os.fstat(file.fileno()).st_size
    except (OSError, FormatError):
        return None
