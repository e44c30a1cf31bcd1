"""The local disk tier: one file per block, crash-safe, bounded in bytes.

Why one file per block with temp-file + fsync + rename + directory fsync: it makes
"readable only once durable" structural. A block's final name appears only after
its bytes and header are on disk, and a store job reports success only after the
directory entry is too; a crash at any moment leaves either the complete old state
or a `.tmp` file that recovery deletes. No log to replay, no torn record to detect:
recovery lists the directory, validates each header (fingerprint, hash = file name,
length) and keeps every complete block. Payload checksums are verified at load,
where the bytes are read anyway; a mismatch drops the file, is counted, and fails
the load (the engine recomputes).

The directory is `<root>/kvtier-<fingerprint>/`. Opening a root that holds blocks of
another layout raises `LayoutMismatchError` (naming both layouts), unless
`on_mismatch="ignore"`, which leaves the foreign directory untouched and unread (and
marks this layout's directory as sharing the root by consent, so the other layout's
next strict open does not fail on it).

One open `DiskStore` owns its directory (an exclusive lock, see `kvtier.store.diskdir`):
a second opener, in this process or another, gets `DirectoryInUseError` naming the
holder's pid. `close()` (or the process's end) gives the directory up.

Threads: writers of different blocks (the cascade worker's thread and its writer
thread, `TransferWorker.submit_write`), a reader and the scheduler's `discard` may run
concurrently; the index is guarded by a lock, each write has a temp file of its own,
and a file is only ever replaced atomically, so a reader sees an old or a new block,
never half.
Each job's blocks are read or written by `io_threads` threads at once (see
`kvtier.store.iothreads`): one thread verifying every block's xxh3 reaches only
about 0.75 of a plain sequential read.
This module does not import torch (crash-recovery tools and tests stay light).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import xxhash

from kvtier.offload.disk_manager import DiskOffloadingManager
from kvtier.store.checksum import ChecksumError, segments_checksum
from kvtier.store.diskdir import (
    DirectoryInUseError,
    check_foreign,
    delete,
    open_directory,
    scan,
)
from kvtier.store.diskformat import (
    NBYTES,
    SUFFIX,
    TMP_SUFFIX,
    BlockHeader,
    FormatError,
    HeaderCheck,
    block_file_bytes,
    chunk_group,
    chunked,
    directory_name,
    durable_write,
    file_name,
    read_hashed,
    sync_directory,
)
from kvtier.store.iothreads import IOThreads
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError, ByBlockHashes
from kvtier.store.slow_io import IOHook, hook_from_env
from kvtier.types import BlockHash

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

_FIXED_HEADER = BlockHeader.size_for(0)  # plus the hash's length
# Jobs of fewer bytes run on the calling thread alone: waking a helper costs tens of
# microseconds, about what reading and hashing this many bytes takes. With tiny blocks
# (the replay's `--data` layout, 256 bytes), a helper per job made a replay ~6% slower.
PARALLEL_MIN_BYTES = 256 << 10


@dataclass(frozen=True)
class DiskStats:
    """What the store has seen since it was opened."""

    num_blocks: int
    used_bytes: int
    recovered: int  # complete blocks found at open
    dropped_at_recovery: int  # torn, foreign or over-capacity files deleted at open
    checksum_failures: int  # loads failed on a payload checksum (block dropped)
    missing: int  # loads of a block with no file


class DiskStore(ByBlockHashes):
    """Blocks as files under `root`; a `BlockStore` over specs with `block_hashes`."""

    def __init__(
        self,
        root: str | Path,
        layout: KVLayout,
        capacity_bytes: int,
        *,
        on_mismatch: Literal["error", "ignore"] = "error",
        fsync: bool = True,
        io_threads: int = 2,
        parallel_min_bytes: int = PARALLEL_MIN_BYTES,
    ) -> None:
        if on_mismatch not in ("error", "ignore"):
            raise ValueError(f"on_mismatch must be 'error' or 'ignore', got {on_mismatch!r}")
        self._layout = layout
        # Capacity is counted with the longest hashes in use (see MAX_KEY_BYTES).
        self.block_file_bytes = block_file_bytes(layout.bytes_per_block)
        if capacity_bytes < self.block_file_bytes:
            raise ValueError(
                f"capacity_bytes {capacity_bytes} is below one block file "
                f"({self.block_file_bytes} bytes)"
            )
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_bytes // self.block_file_bytes
        self.fsync = fsync
        self._io = IOThreads(io_threads, "kvtier-disk-io")
        # tests and benchmarks only: called before each block file's I/O (kvtier.store.slow_io)
        self.io_hook: IOHook | None = hook_from_env()
        if parallel_min_bytes < 0:
            raise ValueError(f"parallel_min_bytes must be >= 0, got {parallel_min_bytes}")
        self._parallel_min_bytes = parallel_min_bytes
        self.root = Path(root)
        self.directory = self.root / directory_name(layout.fingerprint)
        self._prefix = f"{self.directory}{os.sep}"
        self._size = layout.bytes_per_block
        self._header_check = HeaderCheck(layout.fingerprint_bytes, self._size)
        self._group = chunk_group(layout.segment_bytes)
        self._lock = threading.Lock()
        self._local = threading.local()  # each reading thread's reusable xxh3 state
        self._sizes: dict[BlockHash, int] = {}
        self._used = 0
        self._tmp_ids = itertools.count()
        self._dropped: list[BlockHash] = []
        self._checksum_failures = self._missing = self._dropped_at_recovery = 0
        if on_mismatch == "error":
            check_foreign(self.root, self.directory, layout)
        lock = open_directory(
            self.root, self.directory, layout, fsync, shares_root=on_mismatch == "ignore"
        )
        self._release = weakref.finalize(self, os.close, lock)  # at close() or collection
        try:
            self.recovered: list[BlockHash] = self._recover()
        except BaseException:
            self._release()
            raise

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def io_threads(self) -> int:
        return self._io.threads

    def file_bytes(self, block_hash: BlockHash) -> int:
        """Size of the file holding one block (header + payload)."""
        return block_file_bytes(self._layout.bytes_per_block, len(block_hash))

    @staticmethod
    def capacity_for(layout: KVLayout, num_blocks: int) -> int:
        """The `capacity_bytes` that holds exactly `num_blocks` blocks of `layout`."""
        return num_blocks * block_file_bytes(layout.bytes_per_block)

    @staticmethod
    def blocks_for(layout: KVLayout, capacity_bytes: int) -> int:
        """How many blocks of `layout` a budget of `capacity_bytes` holds."""
        return capacity_bytes // block_file_bytes(layout.bytes_per_block)

    # --- recovery -----------------------------------------------------------

    def _recover(self) -> list[BlockHash]:
        """Index every complete block, oldest first; delete temp and invalid files, and
        over capacity (a smaller one than the directory was written with) the oldest
        blocks: the newest are the likeliest to be hit again."""
        found, self._dropped_at_recovery = scan(self.directory, self._header_check, self.file_bytes)
        kept: list[tuple[BlockHash, int]] = []
        for block_hash, size in reversed(found):
            if self._used + size > self.capacity_bytes:
                self._dropped_at_recovery += delete(self._path(block_hash))
                continue
            kept.append((block_hash, size))
            self._used += size
        self._sizes.update(reversed(kept))
        if self.fsync:
            sync_directory(self.directory)
        return list(self._sizes)

    # --- writing ------------------------------------------------------------

    def write(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Buffer]) -> None:
        """Store blocks durably; they are indexed (readable) only when all are on disk."""
        self.write_parts(block_hashes, [[block] for block in blocks])

    def write_parts(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[Sequence[Buffer]]
    ) -> None:
        """`write` for blocks given as their segments in layout order (no gather copy)."""
        if len(block_hashes) != len(blocks):
            raise ValueError(f"{len(blocks)} buffers for {len(block_hashes)} hashes")
        size = self._layout.bytes_per_block
        for parts in blocks:
            got = sum(memoryview(part).nbytes for part in parts)
            if got != size:
                raise ValueError(f"block of {got} bytes, layout needs {size}")
        self._reserve(block_hashes)
        written: list[tuple[BlockHash, int]] = []  # appended to by every I/O thread

        def write_one(index: int) -> None:
            block_hash, parts = block_hashes[index], blocks[index]
            checksum = segments_checksum(parts)
            header = BlockHeader(block_hash, self._layout.fingerprint_bytes, size, checksum)
            raw = header.pack()
            tmp = f"{self._path(block_hash)}.{os.getpid()}-{next(self._tmp_ids)}{TMP_SUFFIX}"
            if self.io_hook is not None:
                self.io_hook("write")
            durable_write(self._path(block_hash), tmp, [raw, *parts], self.fsync)
            written.append((block_hash, len(raw) + size))

        try:
            self._io.for_each(len(block_hashes), write_one, alone=self._small(block_hashes))
            if self.fsync:
                sync_directory(self.directory)
        finally:
            self._settle(block_hashes, written)

    def _reserve(self, block_hashes: Sequence[BlockHash]) -> None:
        """Refuse a write that could take the directory over its byte capacity, or into
        a directory this store no longer owns."""
        if not self._release.alive:
            raise DirectoryInUseError(f"disk tier {self.directory} was closed: reopen it")
        with self._lock:
            new = [h for h in dict.fromkeys(block_hashes) if h not in self._sizes]
            need = sum(self.file_bytes(h) for h in new)
            if self._used + need > self.capacity_bytes:
                raise OSError(
                    f"disk tier full: {self._used} of {self.capacity_bytes} bytes used, "
                    f"{need} more requested"
                )
            for block_hash in new:
                self._sizes[block_hash] = 0  # reserved, not yet readable
            self._used += need

    def _settle(
        self, block_hashes: Sequence[BlockHash], written: list[tuple[BlockHash, int]]
    ) -> None:
        """Index the written blocks (after the directory sync), release the rest."""
        done = dict(written)
        with self._lock:
            for block_hash in dict.fromkeys(block_hashes):
                if self._sizes.get(block_hash) != 0:
                    continue  # was already readable: replaced in place
                if block_hash in done:
                    self._sizes[block_hash] = done[block_hash]
                else:
                    del self._sizes[block_hash]
                    self._used -= self.file_bytes(block_hash)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path(block_hash))

    def _path(self, block_hash: BlockHash) -> str:
        return self._prefix + file_name(block_hash)

    # --- reading and dropping ----------------------------------------------

    def read(self, block_hashes: Sequence[BlockHash], blocks: Sequence[memoryview]) -> None:
        """Fill `blocks`; `BlockLoadError` on a missing or corrupt block (which is dropped)."""
        self.read_parts(block_hashes, [[block] for block in blocks])

    def read_parts(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[Sequence[memoryview]]
    ) -> None:
        """`read` into blocks given as their segments in layout order (no scatter copy)."""
        if len(block_hashes) != len(blocks):
            raise ValueError(f"{len(blocks)} buffers for {len(block_hashes)} hashes")
        with self._lock:  # one look for the whole job (a block dropped since fails to open)
            absent = [h for h in block_hashes if self._sizes.get(h, 0) <= 0]
        if absent:  # the load fails whatever else it reads: fail before reading
            raise self._missing_error(absent[0])
        read = partial(self._read_at, block_hashes, blocks)
        self._io.for_each(len(block_hashes), read, alone=self._small(block_hashes))

    def _small(self, block_hashes: Sequence[BlockHash]) -> bool:
        """Whether a job is too small for a second I/O thread (`parallel_min_bytes`)."""
        return len(block_hashes) * self._size < self._parallel_min_bytes

    def _read_at(
        self,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[Sequence[memoryview]],
        index: int,
    ) -> None:
        """Check block `index`'s buffers, then read it (on whichever I/O thread took it)."""
        parts = blocks[index]
        if sum(map(NBYTES, parts)) != self._size:
            raise ValueError(
                f"buffers of {[p.nbytes for p in parts]} bytes, layout needs {self._size}"
            )
        state: xxhash.xxh3_64 | None = getattr(self._local, "hasher", None)
        if state is None:
            state = self._local.hasher = xxhash.xxh3_64()
        if self.io_hook is not None:
            self.io_hook("read")
        self._read_one(block_hashes[index], parts, state)

    def _read_one(
        self, block_hash: BlockHash, parts: Sequence[memoryview], state: xxhash.xxh3_64
    ) -> None:
        """Read one block straight into `parts` and verify it there, chunk by chunk while
        each is in this core's cache; a missing, torn or corrupt block raises
        `BlockLoadError` (and a damaged file is dropped).

        A hashing thread (reading block i+1 while block i is hashed on the other core)
        was measured and dropped: its hand-offs need the GIL back after every segment's
        hash, and the reader stalls behind it (CPython's GIL convoy); per-layer loads
        got slower. Whole blocks per thread (`read_parts`) need no hand-off at all."""
        path = self._prefix + block_hash.hex() + SUFFIX
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise self._missing_error(block_hash) from None
        raw_header = bytearray(_FIXED_HEADER + len(block_hash))
        size = self._size
        chunks = chunked(parts, self._group)
        try:
            got, checksum = read_hashed(fd, raw_header, chunks, size, state)  # closes fd
        except OSError as exc:  # e.g. the file was replaced by a directory
            raise self._drop_corrupt(block_hash, f"cannot read {path} ({exc.strerror})") from exc
        if got == size and checksum == self._header_check.stored_checksum(raw_header, block_hash):
            return
        try:  # name the damage
            if got > size:
                raise FormatError(f"{path} is longer than one block (bytes appended)")
            if got != size:
                raise FormatError(f"torn block file ({got} of {size} payload bytes)")
            if checksum != self._header_check.payload_checksum(raw_header, block_hash):
                raise ChecksumError(f"checksum mismatch for block {block_hash.hex()}")
        except ValueError as exc:  # FormatError, ChecksumError
            raise self._drop_corrupt(block_hash, str(exc)) from exc

    def _missing_error(self, block_hash: BlockHash) -> BlockLoadError:
        with self._lock:
            self._missing += 1
            self._dropped.append(block_hash)  # the scheduler believes it is here: tell it
        return BlockLoadError(f"disk block {block_hash.hex()} is not stored")

    def _drop_corrupt(self, block_hash: BlockHash, why: str) -> BlockLoadError:
        with self._lock:
            self._checksum_failures += 1
            self._dropped.append(block_hash)
        self.discard([block_hash])
        return BlockLoadError(f"disk block {block_hash.hex()} dropped: {why}")

    def discard(self, block_hashes: Sequence[BlockHash]) -> None:
        """Delete blocks (evicted or failed); absent ones are ignored."""
        for block_hash in block_hashes:
            with self._lock:
                size = self._sizes.get(block_hash)
                if not size:
                    continue  # absent, or a write in flight owns it
                del self._sizes[block_hash]
                self._used -= size
            try:
                os.unlink(self._path(block_hash))
            except FileNotFoundError:
                pass
            except OSError as e:
                # Called from inside the scheduler's prepare_store: never raise there.
                # The byte budget is already released; a restart's recovery scan finds
                # the leftover file and adopts or deletes it.
                logger.warning("disk tier: could not delete %s: %s", block_hash.hex(), e)

    def close(self) -> None:
        """Stop the I/O helper threads and give up the directory (another store may open
        it); reads still work, writes are refused."""
        self._io.close()
        self._release()

    def take_dropped(self) -> list[BlockHash]:
        """Hashes found missing or corrupt since the last call (for the scheduler to forget)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def manager(
        self, block_size: int, cache_policy: str = "lru", enable_events: bool = False
    ) -> DiskOffloadingManager:
        """The scheduler-side manager of this directory: evictions delete files, and the
        blocks recovered at open are registered (oldest first, so LRU evicts them first)."""
        return DiskOffloadingManager.reopened(
            block_size,
            self.capacity_blocks,
            self.recovered,
            self.discard,
            cache_policy,
            enable_events,
        )

    # --- inspection (the BlockStore protocol: ByBlockHashes) -------------------

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            return bool(self._sizes.get(block_hash, 0))  # type: ignore[call-overload]

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(
                num_blocks=sum(1 for size in self._sizes.values() if size),
                used_bytes=self._used,
                recovered=len(self.recovered),
                dropped_at_recovery=self._dropped_at_recovery,
                checksum_failures=self._checksum_failures,
                missing=self._missing,
            )
