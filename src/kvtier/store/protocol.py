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
thread per direction, so a store sees at most one write and one read at a time, and
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
