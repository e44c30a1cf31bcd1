"""Blocks kept by KV head in the shared tier, so engines of any parallel layout share them.

A tensor-parallel worker holds only its own KV heads of every block. Kept as one value
per worker, a block could be read back only by an engine cut the same way; kept as one
value per KV head, every engine of the model reads it, whatever its tensor-parallel
size: each worker reads and writes exactly its heads, and a two-worker engine's block
is a one-worker engine's block. So a block of a model with H KV heads is H values,
under the keys of `head_hashes` (the block hash and the head's index), each with the
remote tier's own envelope (layout fingerprint, the head key's digest, xxh3 checksum).

A block is in the tier only when every head is: a lookup asks for all H values of each
block in order and counts the blocks whose every head is there (one round trip, as
before: the walk only has H times the keys), so a head Redis evicted, or one a worker
failed to write, makes the block a miss for every worker of every engine. A corrupt
head fails that worker's load, and the engine recomputes the block on all its workers.

Models where several workers hold the same bytes (fewer KV heads than workers, or an
MLA latent every worker keeps whole) store them once: `HeadShard.writes` is true on one
of the workers holding a head (the first), and all of them read it.

The per-head value of a block is the head's bytes of every layer in the engine's own
page order (`HeadShard` says nothing about it): the fingerprint that namespaces the
keys names that order, so only engines that cut their pages the same way share.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.offload.abstract import LoadStoreSpec
from kvtier.remote.kv_store import LoadGuard, RemoteStoreError, remote_spec
from kvtier.remote.redis_store import Payload, RedisBlockStore
from kvtier.remote.remote_config import RemoteConfig
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError
from kvtier.validate import positive_int

_MAX_HEADS = 1 << 16  # a head's index is two bytes of its key


def head_hashes(block_hashes: Sequence[bytes], heads: range) -> list[bytes]:
    """The key hashes of `heads` of each block, block by block (a block's heads in order)."""
    suffixes = [head.to_bytes(2, "big") for head in heads]
    return [block_hash + suffix for block_hash in block_hashes for suffix in suffixes]


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
        if self.total > _MAX_HEADS:
            raise ValueError(f"HeadShard.total must be <= {_MAX_HEADS}, got {self.total}")
        if not 0 <= self.first <= self.total - self.count:
            raise ValueError(
                f"HeadShard: heads {self.first}..{self.first + self.count - 1} are not "
                f"among the model's {self.total}"
            )

    @property
    def heads(self) -> range:
        return range(self.first, self.first + self.count)

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


class HeadKeyedStore(RedisBlockStore):
    """A `RedisBlockStore` whose blocks are `heads` values each (see the module docstring).

    Lookups, `store` and `load` speak of whole blocks as the base class does (so the
    remote tier's manager and its asynchronous lookups use it unchanged); a worker
    moves its own heads with `store_heads` / `load_heads`. The store's counters
    (`stats`) count head values, the unit Redis holds."""

    heads: int = 1

    @classmethod
    def connect_heads(
        cls,
        config: RemoteConfig,
        fingerprint: str | bytes,
        heads: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> HeadKeyedStore:
        """`RedisBlockStore.connect`, for blocks of `heads` values each."""
        positive_int("KV heads", heads)
        store = cls.connect(config, fingerprint, clock)
        store.heads = heads
        return store

    @property
    def all_heads(self) -> range:
        return range(self.heads)

    def try_count_prefix(
        self, block_hashes: Sequence[bytes], salt: str | None = None
    ) -> int | None:
        found = super().try_count_prefix(head_hashes(block_hashes, self.all_heads), salt)
        return None if found is None else found // self.heads

    def try_count_prefixes(
        self, questions: Sequence[Sequence[bytes]], salt: str | None = None
    ) -> list[int] | None:
        if len(questions) == 1:  # (the base class would call our try_count_prefix)
            one = self.try_count_prefix(questions[0], salt)
            return None if one is None else [one]
        heads = self.all_heads
        found = super().try_count_prefixes([head_hashes(q, heads) for q in questions], salt)
        return None if found is None else [n // self.heads for n in found]

    def store(
        self,
        block_hashes: Sequence[bytes],
        payloads: Sequence[Payload],
        salt: str | None = None,
    ) -> bool:
        """Whole blocks, each cut into `heads` equal values."""
        if len(block_hashes) != len(payloads):
            raise ValueError(f"{len(block_hashes)} hashes but {len(payloads)} payloads")
        values = split_heads(payloads, self.heads)
        return self.store_heads(block_hashes, self.all_heads, values, salt)

    def load(
        self, block_hashes: Sequence[bytes], salt: str | None = None
    ) -> list[memoryview | None]:
        """Whole blocks (their heads joined), None where any head is not servable."""
        values = self.load_heads(block_hashes, self.all_heads, salt)
        out: list[memoryview | None] = []
        for first in range(0, len(values), self.heads):
            parts = values[first : first + self.heads]
            whole = all(p is not None for p in parts)
            out.append(memoryview(b"".join(p for p in parts if p is not None)) if whole else None)
        return out

    def store_heads(
        self,
        block_hashes: Sequence[bytes],
        heads: range,
        values: Sequence[Payload],
        salt: str | None = None,
    ) -> bool:
        """`values`: each block's values of `heads`, block by block; False if any write
        may have failed."""
        return super().store(head_hashes(block_hashes, heads), values, salt)

    def load_heads(
        self, block_hashes: Sequence[bytes], heads: range, salt: str | None = None
    ) -> list[memoryview | None]:
        """Each block's verified values of `heads`, block by block (None: not servable)."""
        return super().load(head_hashes(block_hashes, heads), salt)


def split_heads(rows: Sequence[Payload], heads: int) -> list[memoryview]:
    """Each row cut into `heads` equal views, row by row (no copy)."""
    out: list[memoryview] = []
    for row in rows:
        view = memoryview(row).cast("B")
        if len(view) % heads:
            raise ValueError(f"a block of {len(view)} bytes does not cut into {heads} heads")
        size = len(view) // heads
        out.extend(view[i * size : (i + 1) * size] for i in range(heads))
    return out


class HeadShardKVStore:
    """One worker's heads of the shared tier as a data-plane `BlockStore`: a row of
    `layout` is the worker's heads one after the other (`shard.count` equal values)."""

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

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def write_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        remote = remote_spec(spec, blocks)
        if not self.shard.writes:  # another worker holds the same bytes and writes them
            return
        values = split_heads(blocks, self.shard.count)
        if not self.store.store_heads(remote.block_hashes, self.shard.heads, values, remote.salt):
            raise RemoteStoreError(
                f"remote store of {len(blocks)} blocks (heads {self.shard.heads}) failed"
            )

    def read_blocks(self, spec: LoadStoreSpec, blocks: Sequence[memoryview]) -> None:
        remote = remote_spec(spec, blocks)
        heads = self.shard.heads
        values = self.store.load_heads(remote.block_hashes, heads, remote.salt)
        rows = split_heads(blocks, self.shard.count)
        for i, (row, value) in enumerate(zip(rows, values, strict=True)):
            if value is None or len(value) != len(row):
                block_hash = remote.block_hashes[i // len(heads)]
                head = heads[i % len(heads)]
                size = "absent or refused" if value is None else f"{len(value)} bytes"
                raise BlockLoadError(
                    f"remote block {block_hash.hex()} head {head} not servable ({size}, "
                    f"expected {len(row)} verified bytes); recompute it"
                )
        guard: LoadGuard | None = getattr(remote, "guard", None)  # a deadline, see LoadGuard
        with contextlib.nullcontext() if guard is None else guard.copying("a remote load"):
            for row, value in zip(rows, values, strict=True):
                assert value is not None  # checked above
                row[:] = value
