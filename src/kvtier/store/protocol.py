"""What a block store must implement to be driven by a transfer worker.

A store only sees host bytes: the worker gathers each device block into one
contiguous host row (layout byte order, `KVLayout.bytes_per_block` long) before
`write_blocks`, and scatters rows back to the device after `read_blocks`. So a new
medium (disk, Redis, ...) is a class with three members, and plugs into
`kvtier.transfer.TransferWorker.for_store(kv, store)`:

```python
class MyStore:
    layout: KVLayout                      # its fingerprint guards the medium

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        # Persist blocks[i] under the i-th entry of `spec`. Return only once every
        # block is durable and readable; raise (any Exception) on failure.

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        # Fill the writable blocks[i] with the bytes stored for the i-th entry of
        # `spec`. Verify checksums; raise BlockLoadError on a missing or corrupt
        # block (after dropping it and counting it).
```

Optional, for speed: a store may also implement `write_segments(spec, blocks)` and
`read_segments(spec, blocks)`, where `blocks[i]` is the list of block i's segments
in layout order (`KVLayout.num_segments` views). On a CPU device the worker then
hands it the engine's own memory, segment by segment, and skips the gather/scatter
copy through staging rows (the disk store writes them with one `writev`).

`spec` is whatever the medium's offloading `Backend` hands out (slot ids for CPU,
block hashes for disk and remote stores). Stores are called from worker threads: one
thread per direction, so a store sees at most one write and one read at a time (the
disk store, under the cascade, also writes other blocks from a writer thread), and
must tolerate those two running concurrently. A raised exception fails that job only;
the worker reports it and never lets it reach the scheduler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.store.layout import KVLayout
from kvtier.types import BlockHash


class BlockLoadError(RuntimeError):
    """A load could not return intact bytes (missing, torn or corrupt block)."""


class Guard(Protocol):
    """A load that may be given up (`kv_store.LoadGuard`): `copying` holds off the
    giving up while a copy into the engine runs, and raises if it came first."""

    def copying(self, what: str) -> AbstractContextManager[None]: ...


def holding(guard: Guard | None, what: str) -> AbstractContextManager[None]:
    """The copy of a load into the engine's memory, under its guard if it has one."""
    return contextlib.nullcontext() if guard is None else guard.copying(what)


@runtime_checkable
class BlockStore(Protocol):
    """A medium holding whole blocks as host bytes; see the module docstring."""

    @property
    def layout(self) -> KVLayout: ...

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None: ...

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None: ...


class _HashAddressed(Protocol):
    """What `ByBlockHashes` needs of the store it serves."""

    def write(self, block_hashes: Sequence[BlockHash], blocks: Sequence[memoryview]) -> None: ...

    def read(self, block_hashes: Sequence[BlockHash], blocks: Sequence[memoryview]) -> None: ...

    def write_parts(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[Sequence[memoryview]]
    ) -> None: ...

    def read_parts(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[Sequence[memoryview]]
    ) -> None: ...


class ByBlockHashes:
    """The BlockStore protocol for a store addressed by block hash (the disk tiers, one
    owner's directory or a shared one): each spec's `block_hashes` handed to the store's
    own `write`, `read`, `write_parts` and `read_parts`."""

    def write_blocks(
        self: _HashAddressed, spec: LoadStoreSpec, blocks: Sequence[memoryview]
    ) -> None:
        self.write(hashes_of(self, spec), blocks)

    def read_blocks(
        self: _HashAddressed, spec: LoadStoreSpec, blocks: Sequence[memoryview]
    ) -> None:
        self.read(hashes_of(self, spec), blocks)

    # The optional segment extension of the protocol (see the module docstring).

    def write_segments(
        self: _HashAddressed, spec: LoadStoreSpec, blocks: Sequence[Sequence[memoryview]]
    ) -> None:
        self.write_parts(hashes_of(self, spec), blocks)

    def read_segments(
        self: _HashAddressed, spec: LoadStoreSpec, blocks: Sequence[Sequence[memoryview]]
    ) -> None:
        self.read_parts(hashes_of(self, spec), blocks)


def hashes_of(store: object, spec: LoadStoreSpec) -> Sequence[BlockHash]:
    """A spec's block hashes; a TypeError naming the store where it has none."""
    hashes: Sequence[BlockHash] | None = getattr(spec, "block_hashes", None)
    if hashes is None:
        raise TypeError(
            f"{type(store).__name__} needs a spec with block_hashes, got {type(spec).__name__}"
        )
    return hashes
