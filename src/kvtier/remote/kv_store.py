"""The remote tier as a data-plane `BlockStore`: plugs into `TransferWorker.for_store`.

The transfer worker gathers each device block into one host row and calls
`write_blocks` / `read_blocks` on its own threads, so Redis round trips never run
on the scheduler thread. A failed write raises (the worker reports the job
failed and the scheduler calls `complete_store(..., success=False)`); a block
that is missing, corrupt or foreign raises `BlockLoadError` after being counted
(and, if corrupt, deleted), and the engine recomputes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.remote.codec import fingerprint_digest
from kvtier.remote.redis_store import RedisBlockStore
from kvtier.remote.remote_manager import RemoteLoadStoreSpec
from kvtier.store.layout import KVLayout, LayoutMismatchError
from kvtier.store.protocol import BlockLoadError


class RemoteStoreError(RuntimeError):
    """A write to the remote tier failed (server down, timeout, breaker open)."""


def remote_spec(spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> RemoteLoadStoreSpec:
    """`spec` as the remote tier's, naming one block per row of `blocks` (else an error)."""
    if not isinstance(spec, RemoteLoadStoreSpec):
        raise TypeError(f"the remote store takes a RemoteLoadStoreSpec, got {spec!r}")
    if len(spec.block_hashes) != len(blocks):
        raise ValueError(f"{len(spec.block_hashes)} hashes in the spec but {len(blocks)} blocks")
    return spec


def _bytes_view(block: memoryview) -> memoryview:
    return block if block.format == "B" and block.ndim == 1 else block.cast("B")


class RedisKVStore:
    def __init__(self, store: RedisBlockStore, layout: KVLayout) -> None:
        if store.codec.fp_digest != fingerprint_digest(layout.fingerprint):
            raise LayoutMismatchError(
                f"the remote store was opened for another layout fingerprint than "
                f"{layout.fingerprint} ({layout.describe()}); refusing to mix blocks"
            )
        self.store = store
        self._layout = layout

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        remote = remote_spec(spec, blocks)
        rows = [_bytes_view(b) for b in blocks]
        if not self.store.store(remote.block_hashes, rows, remote.salt):
            raise RemoteStoreError(f"remote store of {len(rows)} blocks failed")

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        remote = remote_spec(spec, blocks)
        payloads = self.store.load(remote.block_hashes, remote.salt)
        for block_hash, payload, block in zip(remote.block_hashes, payloads, blocks, strict=True):
            row = _bytes_view(block)
            if payload is None or len(payload) != len(row):
                size = "absent" if payload is None else f"{len(payload)} bytes"
                raise BlockLoadError(
                    f"remote block {block_hash.hex()} not servable ({size}, "
                    f"expected {len(row)} verified bytes); recompute it"
                )
            row[:] = payload
