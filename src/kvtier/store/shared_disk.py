"""One worker's heads of a disk tier directory shared by several engines (`shared_dir`).

`DiskStore` is one owner's directory of one worker's shards. Here engines of any
tensor-parallel size write one directory (on NFS, a cluster file system), each worker
its heads of a block as one file, named by the block and the heads (`shared_dir`), so
an engine of another layout reads exactly its heads out of them, as the shared Redis
tier does with its values (`kvtier.remote.head_keys`, whose envelope a file reuses:
`head_codec.GroupCodec`, a 40-byte header and each head's xxh3, 8 bytes a head).

A row (what the cascade hands over: a CPU slot or the engine's segments) is this
worker's pages one after the other, each page its heads one after the other (vLLM's
head-major `LBHNC` cache); a file holds the heads one after the other, each head every
page's part of it: a head of any engine is then one byte range of the file. A file of
this worker's own grouping is read as `DiskStore` reads a block (one `readv` of header
and payload into the row's pieces, here each head's xxh3 checked instead of one over
the block); one of another grouping is read by `pread` of its header and of this
worker's heads' byte range, each head verified.

Several engines, no lock:
- writes go to a unique temp name (`<final>.<writer>-<n>.tmp`, `writer` random per open
  store) and are renamed into place: two engines writing one block leave one complete
  file, either's;
- a store opening the directory deletes only temp files older than `temp_max_age_s`
  (their writer died; see `shared_dir.TEMP_MAX_AGE_S`), never a write in flight;
- a store owns (counts against its budget, and deletes when the scheduler lets the block
  go) the files it wrote, and at open the files of its own head group it finds there,
  newest first up to its budget (a restart remembers). So two engines of one grouping
  may both own a file: whichever evicts it first deletes it, and the other's next load
  of it fails and is recomputed (counted as missing), never served wrong;
- a file found corrupt is deleted by whoever reads it (nobody could use it);
- a block it never wrote is read all the same: the scheduler side decides it is there
  by `shared_dir.probe` (a `stat` per file), and a load that finds a head missing or
  corrupt fails, so the engine recomputes the block on every worker.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash

from kvtier.remote.codec import DecodeStatus
from kvtier.remote.head_codec import GroupCodec, HeadGroup, header_size
from kvtier.store.disk_store import DiskStats
from kvtier.store.diskdir import delete
from kvtier.store.diskformat import TMP_SUFFIX, durable_write, read_into, sync_directory
from kvtier.store.iothreads import IOThreads
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError, ByBlockHashes
from kvtier.store.shared_dir import (
    TEMP_MAX_AGE_S,
    covering,
    file_name,
    open_shared,
    parse_name,
    reclaim_temps,
    shared_directory,
)
from kvtier.types import BlockHash

Buffer = bytes | bytearray | memoryview


class SharedDiskStore(ByBlockHashes):
    """`group`'s heads of `total` in the shared directory of one-head layout `shared`
    under `root`; a `BlockStore` (with segments) over rows of `row`. `writes=False`:
    another worker holding the same heads writes them (fewer KV heads than workers)."""

    def __init__(
        self,
        root: str | Path,
        shared: KVLayout,
        row: KVLayout,
        total: int,
        group: HeadGroup,
        capacity_bytes: int,
        *,
        writes: bool = True,
        fsync: bool = True,
        io_threads: int = 2,
        temp_max_age_s: float = TEMP_MAX_AGE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if group.end > total or total % group.count:
            raise ValueError(f"heads {list(group.heads)} are not a group of {total} KV heads")
        self.head_bytes = shared.bytes_per_block
        if row.bytes_per_block != group.count * self.head_bytes:
            raise ValueError(
                f"a row of {row.bytes_per_block} bytes is not {group.count} heads of "
                f"{self.head_bytes} bytes"
            )
        if self.head_bytes % row.num_layers:
            raise ValueError(f"a head of {self.head_bytes} bytes is not {row.num_layers} pages")
        if temp_max_age_s <= 0:
            raise ValueError(f"temp_max_age_s must be > 0, got {temp_max_age_s}")
        self._layout, self.shared, self.total, self.group = row, shared, total, group
        self.writes, self.fsync = writes, fsync
        self.file_bytes = header_size(group.count) + row.bytes_per_block
        if capacity_bytes < self.file_bytes:
            raise ValueError(
                f"capacity_bytes {capacity_bytes} is below one block file ({self.file_bytes} bytes)"
            )
        self.capacity_bytes = capacity_bytes
        self.directory = shared_directory(root, shared)
        self._prefix = f"{self.directory}{os.sep}"
        self._pages = row.num_layers
        self._codecs: dict[HeadGroup, GroupCodec] = {}
        self._plans: dict[tuple[int, ...], list[list[tuple[int, int, int]]]] = {}
        self._io = IOThreads(io_threads, "kvtier-shared-disk-io")
        self._writer = os.urandom(6).hex()
        self._tmp_ids = itertools.count()
        self._lock = threading.Lock()
        self._own: dict[BlockHash, int] = {}  # files this store owns: 0 while being written
        self._used = 0
        self._dropped: list[BlockHash] = []
        self._corrupt = self._missing = 0
        open_shared(self.directory, shared, fsync)
        self._reclaimed = reclaim_temps(self.directory, clock(), temp_max_age_s)
        self.recovered: list[BlockHash] = self._adopt_own()

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def _codec(self, group: HeadGroup) -> GroupCodec:
        codec = self._codecs.get(group)
        if codec is None:
            codec = self._codecs[group] = GroupCodec.for_group(self.shared.fingerprint, group)
        return codec

    def _path(self, block_hash: bytes, group: HeadGroup | None = None) -> str:
        return self._prefix + file_name(block_hash, group or self.group)

    def _adopt_own(self) -> list[BlockHash]:
        """Own the files of this store's head group found at open, newest first up to the
        budget (their headers checked: a torn or foreign one is deleted); oldest first."""
        found: list[tuple[int, BlockHash]] = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                parsed = parse_name(entry.name)
                if parsed is not None and parsed[1] == self.group:
                    with contextlib.suppress(FileNotFoundError):
                        found.append((entry.stat().st_mtime_ns, parsed[0]))
        kept: list[BlockHash] = []
        for _, block_hash in sorted(found, reverse=True):
            if self._used + self.file_bytes > self.capacity_bytes:
                break
            if self._header_ok(block_hash):
                self._own[block_hash] = self.file_bytes
                self._used += self.file_bytes
                kept.append(block_hash)
        return kept[::-1]

    def _header_ok(self, block_hash: BlockHash) -> bool:
        path = self._path(block_hash)
        try:
            with open(path, "rb") as file:
                header = file.read(header_size(self.group.count))
                size = os.fstat(file.fileno()).st_size
        except OSError:
            return False
        status, head_bytes, _ = self._codec(self.group).head_sums(block_hash, header)
        if status is DecodeStatus.OK and head_bytes == self.head_bytes and size == self.file_bytes:
            return True
        delete(path)
        return False

    # --- a row's heads -------------------------------------------------------

    def _heads_of(self, parts: Sequence[Buffer]) -> list[list[memoryview]]:
        """Each of this worker's heads in a row given as `parts` (layout order): its part
        of every page, as views of `parts` (no copy)."""
        views = [p if isinstance(p, memoryview) else memoryview(p) for p in parts]
        views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
        if self.group.count == 1:
            return [views]
        sizes = tuple(len(v) for v in views)
        plan = self._plans.get(sizes)
        if plan is None:  # one per shape of rows (a whole row, or the engine's segments)
            plan = self._plans[sizes] = self._plan(sizes)
        return [[views[i][start:stop] for i, start, stop in head] for head in plan]

    def _plan(self, sizes: tuple[int, ...]) -> list[list[tuple[int, int, int]]]:
        """For each head, the (part, start, stop) pieces of it in a row of parts of
        `sizes` bytes: its part of each page, in page order."""
        ends = list(itertools.accumulate(sizes))
        piece = self.head_bytes // self._pages  # one head's part of one page
        page = piece * self.group.count
        return [
            [
                cut
                for p in range(self._pages)
                for cut in _cuts(ends, p * page + j * piece, p * page + (j + 1) * piece)
            ]
            for j in range(self.group.count)
        ]

    # --- writing -------------------------------------------------------------

    def write(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Buffer]) -> None:
        self.write_parts(block_hashes, [[block] for block in blocks])

    def write_parts(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[Sequence[Buffer]]
    ) -> None:
        """This worker's heads of each block as one file, durably; a block already in
        the directory (another engine's) is written again all the same (the same bytes)."""
        if len(block_hashes) != len(blocks):
            raise ValueError(f"{len(blocks)} buffers for {len(block_hashes)} hashes")
        size = self._layout.bytes_per_block
        for parts in blocks:
            got = sum(memoryview(part).nbytes for part in parts)
            if got != size:
                raise ValueError(f"block of {got} bytes, layout needs {size}")
        if not self.writes:
            return
        self._reserve(block_hashes)
        written: list[BlockHash] = []

        def write_one(index: int) -> None:
            block_hash = block_hashes[index]
            heads = self._heads_of(blocks[index])
            sums = [_xxh3(head) for head in heads]
            header = self._codec(self.group).header_for(block_hash, self.head_bytes, sums)
            final = self._path(block_hash)
            tmp = f"{final}.{self._writer}-{next(self._tmp_ids)}{TMP_SUFFIX}"
            durable_write(final, tmp, [header, *(v for head in heads for v in head)], self.fsync)
            written.append(block_hash)

        try:
            self._io.for_each(len(block_hashes), write_one)
            if self.fsync:
                sync_directory(self.directory)
        finally:
            self._settle(block_hashes, set(written))

    def _reserve(self, block_hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            new = [h for h in dict.fromkeys(block_hashes) if h not in self._own]
            need = len(new) * self.file_bytes
            if self._used + need > self.capacity_bytes:
                raise OSError(
                    f"shared disk tier full for this store: {self._used} of "
                    f"{self.capacity_bytes} bytes used, {need} more requested"
                )
            for block_hash in new:
                self._own[block_hash] = 0
            self._used += need

    def _settle(self, block_hashes: Sequence[BlockHash], written: set[BlockHash]) -> None:
        with self._lock:
            for block_hash in dict.fromkeys(block_hashes):
                if self._own.get(block_hash) != 0:
                    continue  # owned already: replaced in place
                if block_hash in written:
                    self._own[block_hash] = self.file_bytes
                else:
                    del self._own[block_hash]
                    self._used -= self.file_bytes

    # --- reading -------------------------------------------------------------

    def read(self, block_hashes: Sequence[BlockHash], blocks: Sequence[memoryview]) -> None:
        self.read_parts(block_hashes, [[block] for block in blocks])

    def read_parts(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[Sequence[memoryview]]
    ) -> None:
        """Fill each row with this worker's verified heads of the block, from its own
        grouping's file or else another grouping's files; `BlockLoadError` where no
        grouping has them all intact (the engine recomputes the block)."""
        if len(block_hashes) != len(blocks):
            raise ValueError(f"{len(blocks)} buffers for {len(block_hashes)} hashes")
        self._io.for_each(len(block_hashes), lambda i: self._read_one(block_hashes[i], blocks[i]))

    def _read_one(self, block_hash: BlockHash, parts: Sequence[memoryview]) -> None:
        got = sum(p.nbytes for p in parts)
        if got != self._layout.bytes_per_block:
            raise ValueError(f"buffers of {got} bytes, layout needs {self._layout.bytes_per_block}")
        heads = self._heads_of(parts)
        found = [False]  # whether a file was refused (corrupt) rather than missing

        def read_group(source: HeadGroup) -> bool:
            return self._read_from(block_hash, source, heads, found)

        # its own grouping's file first (the usual case: no other grouping asked), then
        # every grouping in order (the own file again: gone, or deleted if corrupt)
        if read_group(self.group) or covering(read_group, self.group, self.total, self.group.count):
            return
        with self._lock:
            self._dropped.append(block_hash)  # the scheduler believes it is here: tell it
            if found[0]:
                self._corrupt += 1
            else:
                self._missing += 1
            self._used -= self._own.pop(block_hash, 0)
        what = "corrupt (deleted)" if found[0] else "not stored"
        raise BlockLoadError(
            f"shared disk block {block_hash.hex()} heads {self.group.first}.."
            f"{self.group.end - 1}: {what}; recompute it"
        )

    def _read_from(
        self,
        block_hash: BlockHash,
        source: HeadGroup,
        heads: list[list[memoryview]],
        found: list[bool],
    ) -> bool:
        """Read this worker's heads that `source`'s file holds into their views and
        verify each; False (a corrupt file deleted) if they are not all there intact."""
        path = self._path(block_hash, source)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        first, end = max(source.first, self.group.first), min(source.end, self.group.end)
        mine = heads[first - self.group.first : end - self.group.first]
        views = [v for head in mine for v in head]
        want = len(mine) * self.head_bytes
        raw = bytearray(header_size(source.count))
        try:
            if source == self.group:  # the whole file, as DiskStore reads a block
                spare = bytearray(1)
                got = read_into(fd, [raw, *views, spare], len(raw) + want) - len(raw)
            else:
                got_header = os.preadv(fd, [raw], 0)
                offset = len(raw) + (first - source.first) * self.head_bytes
                got = os.preadv(fd, views, offset) if got_header == len(raw) else -1
        except OSError:
            got = -1
        finally:
            os.close(fd)
        codec = self._codec(source)
        status, head_bytes, sums = codec.head_sums(block_hash, bytes(raw))
        ok = status is DecodeStatus.OK and head_bytes == self.head_bytes and got == want
        if ok:
            ok = all(_xxh3(head) == sums[i + first - source.first] for i, head in enumerate(mine))
        if not ok:
            found[0] = True
            self._forget(block_hash, source)
        return ok

    def _forget(self, block_hash: BlockHash, source: HeadGroup) -> None:
        """Delete a corrupt file (nobody could use it); stop owning it if it was ours."""
        delete(self._path(block_hash, source))
        if source == self.group:
            with self._lock:
                self._used -= self._own.pop(block_hash, 0)

    # --- dropping and inspection --------------------------------------------

    def discard(self, block_hashes: Sequence[BlockHash]) -> None:
        """Delete the files of these blocks that this store owns; others are left to
        their owners (the scheduler letting a block go says nothing of other engines)."""
        for block_hash in block_hashes:
            with self._lock:
                size = self._own.get(block_hash)
                if not size:
                    continue  # not ours, or a write in flight owns it
                del self._own[block_hash]
                self._used -= size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(block_hash))

    def take_dropped(self) -> list[BlockHash]:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            return bool(self._own.get(block_hash, 0))  # type: ignore[call-overload]

    def close(self) -> None:
        self._io.close()

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(
                num_blocks=sum(1 for size in self._own.values() if size),
                used_bytes=self._used,
                recovered=len(self.recovered),
                dropped_at_recovery=self._reclaimed,
                checksum_failures=self._corrupt,
                missing=self._missing,
            )


def _xxh3(views: Sequence[Buffer]) -> int:
    if len(views) == 1:
        return int(xxhash.xxh3_64_intdigest(views[0]))
    state = xxhash.xxh3_64()
    any(map(state.update, views))  # update returns None: a C-level loop over all
    return int(state.intdigest())


def _cuts(ends: list[int], start: int, end: int) -> list[tuple[int, int, int]]:
    """The (part, start, stop) pieces of bytes [start, end) of parts ending at `ends`."""
    out = []
    i = bisect.bisect_right(ends, start)
    while start < end:
        begin = ends[i - 1] if i else 0
        stop = min(end, ends[i])
        out.append((i, start - begin, stop - begin))
        start = stop
        i += 1
    return out
