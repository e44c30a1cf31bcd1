"""The offloading-manager bookkeeping of the remote tier.

Unlike the CPU and disk tiers, the truth about what is stored lives in Redis,
shared with other engines and evicted by Redis itself. So this manager keeps no
block table: `lookup` asks the server (one round trip, stopping at the first
hole), `prepare_store` offers every hash not already in flight from this
engine, and no "removed" events are ever emitted (Redis evicts silently; a block
that vanished between lookup and load fails that load, which the engine answers
by recomputing). The only local state is what is in flight, so caller mistakes
(completing a load never prepared, keys that are not bytes) are still refused.
Repeated hashes follow the other managers (docs/vllm-differences.md): a load pins
once per listing, a store takes each hash once.

`touch` is a no-op on purpose: a load's GET already refreshes Redis's LRU/LFU
clock, and a synchronous round trip just to age blocks served by an upper tier
is not worth scheduler time.

`async_lookup=True` answers lookups from a background thread (None, "ask again",
until the answer is in; see `async_lookup.py`), so the scheduler never waits on
the network. `synthetic_payload_bytes` is for replays that drive the bookkeeping without a
data plane: the manager then writes placeholder blocks of that size at
`complete_store` and reads them back at `prepare_load`, so the server's
contents (and the byte counters) behave as they would with real KV bytes.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from kvtier.offload.abstract import (
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    block_hash_list,
    unique_hashes,
)
from kvtier.remote.async_lookup import AsyncLookups
from kvtier.remote.redis_store import RedisBlockStore
from kvtier.types import BlockHash
from kvtier.validate import positive_int

MEDIUM = "REMOTE"
MAX_STORED_HERE = 1 << 16  # blocks remembered as stored by this engine (`stored_here`)


def epoch_salt(epoch: int, salt: str | None = None) -> str | None:
    """The key-namespace salt of a reset `epoch` (0: `salt` itself, so the keys of an
    engine that never reset are those of before epochs existed)."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if epoch == 0:
        return salt
    return f"{salt or ''}#epoch{epoch}"


class RemoteLoadStoreSpec(LoadStoreSpec):
    """Blocks in the remote store are addressed by their hashes (and the tenant's salt)."""

    def __init__(
        self,
        block_hashes: list[BlockHash],
        salt: str | None = None,
        holders: list[int] | None = None,
    ) -> None:
        self.block_hashes = block_hashes
        self.salt = salt
        # a load's hint of where each block is, from the scheduler's lookups (a store
        # kept by head: `HeadKeyedStore.holders_of`); it orders the reads, and a wrong
        # one costs a round trip, never a block (every read is verified the same way)
        self.holders = holders
        # blocks of it a lookup read whole, which the load takes from this process
        # (`prefetch`): a load's time is its other blocks' (the cost model's estimate)
        self.prefetched = 0
        # a load's `kv_store.LoadGuard`, set where the bytes move (a worker with a deadline)
        self.guard: Any = None
        # a store's copy of its blocks in host memory, set where the bytes move (the
        # worker's, `StagedHandler.snapshot`): the engine's blocks are free at once
        self.staged: Any = None

    @staticmethod
    def medium() -> str:
        return MEDIUM

    def __repr__(self) -> str:
        return f"RemoteLoadStoreSpec({len(self.block_hashes)} blocks, salt={self.salt!r})"


class RemoteOffloadingManager(OffloadingManager):
    def __init__(
        self,
        store: RedisBlockStore,
        block_size: int,
        *,
        salt: str | None = None,
        enable_events: bool = False,
        synthetic_payload_bytes: int | None = None,
        async_lookup: bool = False,
    ) -> None:
        positive_int("block_size", block_size)
        if synthetic_payload_bytes is not None:
            positive_int("synthetic_payload_bytes", synthetic_payload_bytes)
        self.store = store
        self.block_size = block_size
        self.salt = salt
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._loading: Counter[BlockHash] = Counter()
        self._storing: set[BlockHash] = set()
        self._synthetic = bytes(synthetic_payload_bytes) if synthetic_payload_bytes else None
        self._async = AsyncLookups(store, salt) if async_lookup else None
        # blocks this engine stored, most recent last (`stored_here`)
        self._stored: OrderedDict[BlockHash, None] = OrderedDict()

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        """Leading blocks in Redis (one round trip); with `async_lookup`, None until known."""
        hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
        if self._async is not None:
            return self._async.lookup(hashes)
        return self.store.count_prefix(hashes, self.salt)

    def held_lookups(self) -> AbstractContextManager[None]:
        """Asynchronous lookups asked inside go out together when it ends (see
        `AsyncLookups.held`); nothing changes for synchronous ones."""
        return self._async.held() if self._async is not None else nullcontext()

    def peek_lookup(self, block_hashes: Sequence[BlockHash]) -> int | None:
        """An asynchronous lookup's answer if it is in, without taking it or asking."""
        return self._async.peek(block_hashes) if self._async is not None else None

    def wait_lookups(self, timeout: float | None = None) -> bool:
        """Block until asynchronous lookups have answers; True at once when synchronous."""
        return self._async.wait(timeout) if self._async is not None else True

    def lookup_in_flight(self) -> tuple[int, float] | None:
        """The asynchronous lookups' round trip on its way, numbered, and its seconds so
        far (`AsyncLookups.in_flight`); None between round trips or when synchronous."""
        return self._async.in_flight() if self._async is not None else None

    def fetch_with(self, blocks: Callable[[], int]) -> None:
        """Have asynchronous lookups read the first `blocks()` blocks of a round trip whole
        (`AsyncLookups.fetch_blocks`, `prefetch`)."""
        if self._async is not None:
            self._async.fetch_blocks = blocks

    def prefetched(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of the blocks a lookup read whole for a load here (`prefetch`)."""
        return self.store.prefetched_count(block_hashes, self.salt)

    def stored_here(self, block_hash: BlockHash) -> bool:
        """Whether this engine stored the block (under this salt) among its last
        MAX_STORED_HERE stores: a lookup of it most likely finds it (Redis may have
        evicted it), where one of a block never stored here only finds another engine's."""
        return block_hash in self._stored

    def take_lookup_seconds(self) -> list[float]:
        """Seconds of each asynchronous lookup's round trip since the last call."""
        return self._async.take_seconds() if self._async is not None else []

    def close(self) -> None:
        """Stop the background lookup thread, if any (the store is the tier's to close)."""
        if self._async is not None:
            self._async.close()

    def reset_cache(self, salt: str | None = None) -> list[BlockHash]:
        """Read and write under `salt` from now on (an epoch of the key namespace, see
        `epoch_salt`): blocks of before are never read again by this manager, and Redis
        evicts them as they age. Loads and stores in flight are forgotten (their jobs
        are dropped with the reset). Nothing is listed as removed: Redis holds the truth,
        shared with other engines, and this manager keeps no table of it."""
        self.salt = salt
        if self._async is not None:
            self._async.reset(salt)
        self.store.prefetched.clear()
        self._stored.clear()
        self._loading.clear()
        self._storing.clear()
        return []

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        hashes = block_hash_list("prepare_load", block_hashes)
        self._loading.update(hashes)
        if self._synthetic is not None:
            self.store.load(hashes, self.salt)
        spec = RemoteLoadStoreSpec(hashes, self.salt, self.store.holders_of(hashes))
        spec.prefetched = self.prefetched(hashes)
        return spec

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        hashes = block_hash_list("complete_load", block_hashes)
        # a hash listed k times releases k loads (reading a Counter's absent key
        # does not insert it)
        absent = [h for h, n in Counter(hashes).items() if self._loading[h] < n]
        if absent:
            raise KeyError(f"complete_load: blocks not being loaded (as often): {absent!r}")
        self._loading.subtract(hashes)
        for h in hashes:
            if self._loading[h] == 0:
                del self._loading[h]

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """Offer every hash not already in flight; nothing while the breaker refuses.

        Skipping the store while the server is known down saves the engine the
        device-to-host copies of a job that could only fail.
        """
        hashes = unique_hashes(block_hash_list("prepare_store", block_hashes))
        if self.store.breaker.rejecting():
            hashes = []
        to_store = [h for h in hashes if h not in self._storing]
        self._storing.update(to_store)
        return PrepareStoreOutput(to_store, RemoteLoadStoreSpec(to_store, self.salt), [])

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        listed = unique_hashes(block_hash_list("complete_store", block_hashes))
        hashes = [h for h in listed if h in self._storing]
        self._storing.difference_update(hashes)
        if success and self._synthetic is not None and hashes:
            success = self.store.store(hashes, [self._synthetic] * len(hashes), self.salt)
        if success:
            stored = self._stored
            for h in hashes:
                stored[h] = None
                stored.move_to_end(h)
            while len(stored) > MAX_STORED_HERE:
                stored.popitem(last=False)
            if self._async is not None and hashes:
                self._async.stored(hashes)  # a miss answered before the store is stale
        if success and hashes and self._events is not None:
            self._events.append(OffloadingEvent(hashes, self.block_size, MEDIUM, removed=False))

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self._events is None:
            return
        events, self._events = self._events, []
        yield from events

    @property
    def num_in_flight(self) -> tuple[int, int]:
        """(loads, stores) this engine has prepared and not completed."""
        return sum(self._loading.values()), len(self._storing)
