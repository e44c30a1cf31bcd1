"""The remote tier as a data-plane `BlockStore`: plugs into `TransferWorker.for_store`.

The transfer worker gathers each device block into one host row and calls
`write_blocks` / `read_blocks` on its own threads, so Redis round trips never run
on the scheduler thread. A failed write raises (the worker reports the job
failed and the scheduler calls `complete_store(..., success=False)`); a block
that is missing, corrupt or foreign raises `BlockLoadError` after being counted
(and, if corrupt, deleted), and the engine recomputes it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.remote.codec import fingerprint_digest
from kvtier.remote.redis_store import RedisBlockStore
from kvtier.remote.remote_manager import RemoteLoadStoreSpec
from kvtier.store.layout import KVLayout, LayoutMismatchError
from kvtier.store.protocol import BlockLoadError


class RemoteStoreError(RuntimeError):
    """A write to the remote tier failed (server down, timeout, breaker open)."""


class LoadAbandoned(BlockLoadError):
    """The load passed its deadline and was given up: its blocks are being recomputed."""


class LoadGuard:
    """Lets the owner of a load give it up while its round trip is still out (a deadline):
    after `abandon()` returns, not one byte of the load reaches the engine's memory (the
    copy into it runs under the guard's lock, or not at all), so the blocks the engine
    recomputes meanwhile are never overwritten by a late answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.abandoned = False

    def abandon(self) -> None:
        with self._lock:  # waits for a copy already under way (it is then complete)
            self.abandoned = True

    @contextmanager
    def copying(self, what: str) -> Iterator[None]:
        """Hold off `abandon` while the copy runs; raise `LoadAbandoned` if it came first."""
        with self._lock:
            if self.abandoned:
                raise LoadAbandoned(f"{what} given up at its deadline")
            yield


def remote_spec(spec: LoadStoreSpec, blocks: Sequence[object]) -> RemoteLoadStoreSpec:
    """`spec` as the remote tier's, naming one block per row of `blocks` (else an error)."""
    if not isinstance(spec, RemoteLoadStoreSpec):
        raise TypeError(f"the remote store takes a RemoteLoadStoreSpec, got {spec!r}")
    if len(spec.block_hashes) != len(blocks):
        raise ValueError(f"{len(spec.block_hashes)} hashes in the spec but {len(blocks)} blocks")
    return spec


def serve_prefetched(owner: object, store: RedisBlockStore) -> None:
    """Tell this process's lookups that `store`'s values (whole blocks) are loaded here,
    for as long as `owner` lives (`prefetch`)."""
    store.prefetched.serve(store._base)
    weakref.finalize(owner, store.prefetched.unserve, store._base)


def _bytes_view(block: memoryview) -> memoryview:
    return block if block.format == "B" and block.ndim == 1 else block.cast("B")


class RedisKVStore:
    # a load's copy into the engine's memory runs under its spec's guard (`read_blocks`)
    copies_under_guard = True

    def __init__(self, store: RedisBlockStore, layout: KVLayout) -> None:
        if store.codec.fp_digest != fingerprint_digest(layout.fingerprint):
            raise LayoutMismatchError(
                f"the remote store was opened for another layout fingerprint than "
                f"{layout.fingerprint} ({layout.describe()}); refusing to mix blocks"
            )
        self.store = store
        self._layout = layout
        serve_prefetched(self, store)

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        remote = remote_spec(spec, blocks)
        rows = [_bytes_view(b) for b in blocks]
        if not self.store.store(remote.block_hashes, rows, remote.salt):
            raise RemoteStoreError(f"remote store of {len(rows)} blocks failed")

    def write_pieces(self, spec: LoadStoreSpec, blocks: Sequence[Sequence[memoryview]]) -> None:
        """`write_blocks` of blocks given as the pieces each is end to end (a CPU slot's
        segments, see `KvtierOffloadingWorker`): sent as they lie, not joined."""
        remote = remote_spec(spec, blocks)
        if not self.store.store_pieces(remote.block_hashes, blocks, remote.salt):
            raise RemoteStoreError(f"remote store of {len(blocks)} blocks failed")

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        """Fill `blocks`; a load given a `guard` (an attribute of its spec, see
        `LoadGuard`) copies nothing once it was abandoned."""
        remote = remote_spec(spec, blocks)
        carried = getattr(remote, "prefetched", 0) > 0  # (a spec pickled before there were any)
        payloads = self.store.load(remote.block_hashes, remote.salt, carried)
        guard: LoadGuard | None = getattr(remote, "guard", None)
        if guard is None:
            self._copy(remote, payloads, blocks)
            return
        with guard.copying(f"load of {len(blocks)} remote blocks"):
            self._copy(remote, payloads, blocks)

    @staticmethod
    def _copy(
        remote: RemoteLoadStoreSpec,
        payloads: Sequence[memoryview | None],
        blocks: Sequence[memoryview],
    ) -> None:
        for block_hash, payload, block in zip(remote.block_hashes, payloads, blocks, strict=True):
            row = _bytes_view(block)
            if payload is None or len(payload) != len(row):
                size = "absent" if payload is None else f"{len(payload)} bytes"
                raise BlockLoadError(
                    f"remote block {block_hash.hex()} not servable ({size}, "
                    f"expected {len(row)} verified bytes); recompute it"
                )
            row[:] = payload
