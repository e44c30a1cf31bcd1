"""One tensor-parallel worker's KV heads of the shared Redis tier (`head_keys`).

`HeadShard` says which heads vLLM gives a worker of an engine, and which worker writes
heads that several hold (fewer KV heads than workers, or an MLA latent every worker
keeps whole: written once, by the first, read by all). `HeadShardKVStore` is that
worker's part of the tier as a data-plane `BlockStore`: its heads of a block are one
row, stored as one value and loaded from its own values or, for blocks another layout
wrote, out of that layout's values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.remote.head_codec import HeadGroup
from kvtier.remote.head_keys import MAX_HEADS, HeadKeyedStore
from kvtier.remote.kv_store import LoadGuard, RemoteStoreError, remote_spec, serve_prefetched
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError, holding
from kvtier.validate import positive_int


@dataclass(frozen=True)
class HeadShard:
    """The KV heads one worker holds (`first` .. `first + count - 1` of `total`), and
    whether it is the one that writes them (see the module docstring)."""

    total: int
    first: int
    count: int
    writes: bool = True

    def __post_init__(self) -> None:
        positive_int("HeadShard.total", self.total)
        positive_int("HeadShard.count", self.count)
        if self.total > MAX_HEADS:
            raise ValueError(f"HeadShard.total must be <= {MAX_HEADS}, got {self.total}")
        if not 0 <= self.first <= self.total - self.count:
            raise ValueError(
                f"HeadShard: heads {self.first}..{self.first + self.count - 1} are not "
                f"among the model's {self.total}"
            )

    @property
    def heads(self) -> range:
        return range(self.first, self.first + self.count)

    @property
    def group(self) -> HeadGroup:
        return HeadGroup(self.first, self.count)

    @classmethod
    def of_rank(cls, total: int, workers: int, rank: int) -> HeadShard:
        """The heads vLLM gives tensor-parallel rank `rank` of `workers`: an equal share
        when the heads divide among the workers, else (fewer heads than workers, the
        workers dividing among the heads) one head held by `workers // total` ranks in
        a row, the first of them writing it. Any other split is a ValueError: its
        shards would not be whole heads."""
        positive_int("total KV heads", total)
        positive_int("workers", workers)
        if not 0 <= rank < workers:
            raise ValueError(f"rank {rank} is not one of {workers} workers")
        if total % workers == 0:
            count = total // workers
            return cls(total, rank * count, count)
        if workers % total == 0:
            replicas = workers // total
            return cls(total, rank // replicas, 1, writes=rank % replicas == 0)
        raise ValueError(
            f"{total} KV heads do not divide among {workers} tensor-parallel workers "
            f"(nor {workers} among {total}): a worker would hold part of a head"
        )


class HeadShardKVStore:
    """One worker's heads of the shared tier as a data-plane `BlockStore`: a row of
    `layout` is the worker's heads one after the other (`shard.count` equal runs)."""

    # a load's copy into the engine's memory runs under its spec's guard (`read_blocks`)
    copies_under_guard = True

    def __init__(self, store: HeadKeyedStore, layout: KVLayout, shard: HeadShard) -> None:
        if shard.total != store.heads:
            raise ValueError(f"a shard of {shard.total} heads over a store of {store.heads}")
        if layout.bytes_per_block % shard.count:
            raise ValueError(
                f"a row of {layout.bytes_per_block} bytes does not cut into {shard.count} heads"
            )
        self.store = store
        self.shard = shard
        self._layout = layout
        serve_prefetched(self, store.group_store(shard.group))  # (see `prefetch`)

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        rows = [b if b.format == "B" and b.ndim == 1 else b.cast("B") for b in blocks]
        self.write_pieces(spec, [[row] for row in rows])

    def write_pieces(self, spec: LoadStoreSpec, blocks: Sequence[Sequence[memoryview]]) -> None:
        """`write_blocks` of rows given as the pieces each is end to end (a CPU slot's
        runs in head order, see `handlers.slot_order`): sent as they lie, not joined."""
        remote = remote_spec(spec, blocks)
        if not self.shard.writes:  # another worker holds the same bytes and writes them
            return
        if not self.store.store_group_pieces(
            remote.block_hashes, self.shard.group, blocks, remote.salt
        ):
            raise RemoteStoreError(
                f"remote store of {len(blocks)} blocks (heads {self.shard.heads}) failed"
            )

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        remote = remote_spec(spec, blocks)
        shard = self.shard
        head_bytes = self._layout.bytes_per_block // shard.count
        holders = getattr(remote, "holders", None)  # (a spec pickled before there were any)
        carried = getattr(remote, "prefetched", 0) > 0
        values = self.store.load_group(
            remote.block_hashes, shard.group, head_bytes, remote.salt, holders, carried
        )
        rows = [b if b.format == "B" and b.ndim == 1 else b.cast("B") for b in blocks]
        for block_hash, row, runs in zip(remote.block_hashes, rows, values, strict=True):
            got = None if runs is None else sum(len(run) for run in runs)
            if got != len(row):
                heads = (
                    f"head {shard.first}"
                    if shard.count == 1
                    else f"heads {shard.first}..{shard.first + shard.count - 1}"
                )
                size = "absent or refused" if got is None else f"{got} bytes"
                raise BlockLoadError(
                    f"remote block {block_hash.hex()} {heads} not servable ({size}, "
                    f"expected {len(row)} verified bytes); recompute it"
                )
        guard: LoadGuard | None = getattr(remote, "guard", None)  # a deadline, see LoadGuard
        with holding(guard, "a remote load"):
            for row, runs in zip(rows, values, strict=True):
                assert runs is not None  # checked above
                at = 0
                for run in runs:  # each source value's heads, straight into place
                    row[at : at + len(run)] = run
                    at += len(run)


__all__ = ["HeadShard", "HeadShardKVStore"]
