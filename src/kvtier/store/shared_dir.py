"""A disk tier directory shared by several engines: its names, and what a look finds.

A single-owner directory (`diskdir`) is named by one worker's layout and locked by its
one `DiskStore`. A shared one (on NFS or a cluster file system, written by engines of
any tensor-parallel size) is named by what the bytes are, as the shared Redis tier's
keys are (`kvtier.remote.head_keys`): `<root>/kvtier-<fingerprint>/` where the
fingerprint is that of one KV head of a block (model, dtype, block size, KV-cache
groups, KV heads, vLLM's cache layout), and a worker's heads of a block are one file,
`<hash hex>.h<first>-<end>.kv` (heads [first, end)). Nobody holds a lock on it.

Everything here is a name, a `stat` or a listing: the scheduler side decides with it
whether a block is in the tier (every head there, in files of one grouping), without
reading a byte of any block. Temporary files of a write in flight are named
`<final>.<writer>-<n>.tmp`, `writer` random per open store; a temp file is deleted by
anyone only once it is older than a bound (`TEMP_MAX_AGE_S`): its writer died, as no
write takes that long.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from kvtier.remote.head_codec import HeadGroup, group_sizes, grouping
from kvtier.store.diskdir import delete, read_marker
from kvtier.store.diskformat import (
    LAYOUT_FILE,
    SUFFIX,
    TMP_SUFFIX,
    directory_name,
    durable_write,
    sync_directory,
)
from kvtier.store.layout import KVLayout
from kvtier.types import BlockHash

# A write takes milliseconds; a temp file this old is a dead writer's (or a stalled
# one's, whose rename then fails and is counted as a failed store: never a torn block).
TEMP_MAX_AGE_S = 600.0
_NAME = re.compile(r"^([0-9a-f]+)\.h(\d+)-(\d+)" + re.escape(SUFFIX) + "$")


def shared_directory(root: str | os.PathLike[str], shared: KVLayout) -> Path:
    """The shared directory of blocks of one-head layout `shared` under `root`."""
    return Path(root) / directory_name(shared.fingerprint)


def file_name(block_hash: bytes, group: HeadGroup) -> str:
    """The file of `group`'s heads of one block."""
    return f"{block_hash.hex()}.h{group.first}-{group.end}{SUFFIX}"


def parse_name(name: str) -> tuple[BlockHash, HeadGroup] | None:
    """The block and heads a final file name holds, or None for any other file."""
    match = _NAME.match(name)
    if match is None or len(match.group(1)) % 2:
        return None
    first, end = int(match.group(2)), int(match.group(3))
    if end <= first:
        return None
    return BlockHash(bytes.fromhex(match.group(1))), HeadGroup(first, end - first)


def open_shared(directory: Path, shared: KVLayout, fsync: bool) -> None:
    """Create `directory` with its layout marker (`shares_root`: a single-owner store on
    the same root does not count it as another layout's), or check the marker there.
    Several engines may race here: each writes the same marker, by atomic rename."""
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / LAYOUT_FILE
    if marker.exists():
        shared.check_compatible(read_marker(marker)["fingerprint"], str(directory))
        return
    description = {"fingerprint": shared.fingerprint, **shared.describe()}
    description |= {"shares_root": True, "shared": True}
    data = json.dumps(description, sort_keys=True).encode()
    tmp = f"{marker}.{os.getpid()}-{os.urandom(4).hex()}{TMP_SUFFIX}"
    durable_write(str(marker), tmp, [data], fsync)
    if fsync:
        sync_directory(directory.parent)


def covering(
    exists: Callable[[HeadGroup], bool], want: HeadGroup, total: int, own: int
) -> list[HeadGroup] | None:
    """The files (groups) that hold heads `want`, from the first grouping (in
    `group_sizes(total, own)` order) whose every file covering them `exists`, else None.
    One call of `exists` per file asked about, at most one per file of each grouping."""
    for size in group_sizes(total, own):
        first = want.first // size * size
        groups = [HeadGroup(f, size) for f in range(first, want.end, size)]
        if all(exists(group) for group in groups):
            return groups
    return None


def probe(directory: Path, block_hash: bytes, total: int, own: int) -> bool:
    """Whether every one of `total` heads of the block is in `directory`, in files of one
    grouping: a `stat` per file asked, the engine's own grouping (`own` heads a file)
    first. No byte of the block is read (a corrupt head fails its load: a miss)."""
    prefix = f"{directory}{os.sep}"

    def exists(group: HeadGroup) -> bool:
        return os.path.exists(prefix + file_name(block_hash, group))

    return covering(exists, HeadGroup(0, total), total, own) is not None


def list_whole(directory: Path, total: int) -> list[BlockHash]:
    """The blocks whose every head is in `directory` in files of one grouping, oldest
    (newest file) first: one listing and a `stat` per block file. Read only."""
    files: dict[BlockHash, dict[HeadGroup, int]] = {}
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                parsed = parse_name(entry.name)
                if parsed is not None and entry.is_file(follow_symlinks=False):
                    block_hash, group = parsed
                    files.setdefault(block_hash, {})[group] = entry.stat().st_mtime_ns
    except FileNotFoundError:
        return []
    whole = []
    for block_hash, groups in files.items():
        for size in group_sizes(total, total):
            times = [groups.get(g) for g in grouping(total, size)]
            if all(t is not None for t in times):
                whole.append((max(t for t in times if t is not None), block_hash))
                break
    return [block_hash for _, block_hash in sorted(whole)]


def reclaim_temps(directory: Path, now_s: float, max_age_s: float = TEMP_MAX_AGE_S) -> int:
    """Delete temp files older than `max_age_s` at `now_s` (wall-clock seconds, as
    file times are); a younger one may be another engine's write in flight. Returns
    how many were deleted."""
    deleted = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.endswith(TMP_SUFFIX):
                continue
            try:
                age = now_s - entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue  # renamed into place meanwhile
            if age > max_age_s:
                deleted += delete(entry.path)
    return deleted
