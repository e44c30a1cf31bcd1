"""Opening a disk tier's directory: taking its lock, refusing another layout's blocks,
writing the layout marker, and the recovery scan that finds every complete block after
a crash.

A directory has one owner: `DiskStore` holds an exclusive `flock` on its `lock` file
for as long as it is open. Two owners would each count the other's files against
their own budget, and one's recovery would delete the other's in-flight temporary
files; a second opener is refused, naming the holder's pid. The kernel drops the
lock when its process dies (even by SIGKILL), so a dead owner never blocks a restart.

Kept apart from `DiskStore`'s reads and writes because it runs once, at open, and
is what a crash-recovery tool needs on its own. The scan trusts nothing but a block
file's header (fingerprint, hash = file name, length) and its size: payloads are
verified at load, where they are read anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.store.diskformat import (
    DIR_PREFIX,
    LAYOUT_FILE,
    LOCK_FILE,
    TMP_SUFFIX,
    BlockHeader,
    FormatError,
    HeaderCheck,
    block_file_bytes,
    directory_name,
    durable_write,
    hash_of,
    sync_directory,
)
from kvtier.store.layout import KVLayout, LayoutMismatchError
from kvtier.types import BlockHash


class DirectoryInUseError(OSError):
    """Another open `DiskStore` (this process or another) owns the directory."""


def read_marker(marker: Path) -> dict[str, Any]:
    """A directory's layout marker; a ValueError naming the file says what is wrong."""
    try:
        found = json.loads(marker.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise FormatError(
            f"{marker}: layout marker is not valid JSON ({e}); expected an object with "
            "'fingerprint'. Delete the directory if it holds nothing you need"
        ) from None
    if not isinstance(found, dict) or not isinstance(found.get("fingerprint"), str):
        raise FormatError(
            f"{marker}: layout marker must be a JSON object with a 'fingerprint' string, "
            f"got {str(found)[:80]!r}"
        )
    return found


def check_foreign(root: Path, directory: Path, layout: KVLayout) -> None:
    """Raise `LayoutMismatchError` if `root` holds another layout's block directory
    (one opened with on_mismatch='ignore' shares the root by consent: not counted)."""
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(DIR_PREFIX) and entry.name != directory.name and entry.is_dir():
            try:
                theirs = read_marker(entry / LAYOUT_FILE)
            except (OSError, ValueError):
                theirs = {"fingerprint": entry.name[len(DIR_PREFIX) :]}
            if theirs.get("shares_root"):
                continue
            raise LayoutMismatchError(
                f"{root} holds KV blocks of another layout ({theirs}) in {entry}; "
                f"this cache's layout is {layout.fingerprint} "
                f"({layout.describe()}). Use another directory, delete it, or "
                "open with on_mismatch='ignore' to leave it untouched"
            )


def open_directory(
    root: Path, directory: Path, layout: KVLayout, fsync: bool, shares_root: bool = False
) -> int:
    """Create `directory`, take its lock and write its layout marker, or check the marker
    already there. Returns the lock's file descriptor (closing it releases the lock)."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = lock_directory(directory)
    try:
        marker = directory / LAYOUT_FILE
        if marker.exists():
            found = read_marker(marker)
            layout.check_compatible(found["fingerprint"], str(directory))
            return lock
        description = {"fingerprint": layout.fingerprint, **layout.describe()}
        if shares_root:
            description["shares_root"] = True
        data = json.dumps(description, sort_keys=True).encode()
        durable_write(str(marker), f"{marker}.{os.getpid()}{TMP_SUFFIX}", [data], fsync)
        if fsync:
            sync_directory(root)
    except BaseException:
        os.close(lock)
        raise
    return lock


def lock_directory(directory: Path) -> int:
    """Take `directory`'s exclusive lock, or raise `DirectoryInUseError` naming its holder."""
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        mine = " (this process)" if holder == str(os.getpid()) else ""
        raise DirectoryInUseError(
            f"disk tier directory {directory} is in use by process {holder}{mine} "
            f"(lock {path}); a directory has one owner at a time: give each cache its "
            "own directory, or close the other DiskStore first"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def reclaim_abandoned(parent: Path, prefix: str) -> int:
    """Delete `parent`'s directories named `prefix*` (this user's) whose every block
    directory's lock is free: their owners died without cleaning up. Returns how many."""
    reclaimed = 0
    try:
        candidates = [p for p in parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return 0
    for candidate in candidates:
        with contextlib.suppress(OSError):
            if candidate.is_symlink() or candidate.stat().st_uid != os.getuid():
                continue
            locks = list(candidate.glob(f"{DIR_PREFIX}*/{LOCK_FILE}"))
            if not locks:  # being created (its store not open yet), or not ours
                continue
            held = []
            try:
                for lock in locks:
                    held.append(lock_directory(lock.parent))
            except DirectoryInUseError:
                continue
            finally:
                for fd in held:
                    os.close(fd)
            shutil.rmtree(candidate)
            reclaimed += 1
    return reclaimed


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
            if not entry.is_file(follow_symlinks=False):
                raise FormatError(
                    f"{entry.path}: a block file's name, but not a regular file; "
                    "only kvtier writes in a disk tier's directory: move it away"
                )
            size = _valid_size(entry.path, block_hash, header_check)
            if size is None or size != file_bytes(block_hash):
                deleted += delete(entry.path)
            else:
                found.append((entry.stat().st_mtime_ns, block_hash, size))
    found.sort()
    return [(block_hash, size) for _, block_hash, size in found], deleted


def list_blocks(root: str | os.PathLike[str], layout: KVLayout) -> list[BlockHash]:
    """The block files of `layout` under a disk tier's `root`, oldest first, by name and
    size alone. Read only: for a reader beside the directory's owner (vLLM's scheduler
    process, whose worker opened and recovered the directory), which must never delete
    behind it; a missing directory holds no blocks."""
    directory = Path(root) / directory_name(layout.fingerprint)
    found: list[tuple[int, BlockHash]] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                block_hash = hash_of(entry.name)
                if block_hash is None or not entry.is_file(follow_symlinks=False):
                    continue
                stat = entry.stat()
                if stat.st_size == block_file_bytes(layout.bytes_per_block, len(block_hash)):
                    found.append((stat.st_mtime_ns, block_hash))
    except FileNotFoundError:
        return []
    return [block_hash for _, block_hash in sorted(found)]


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
