"""The offloading-manager interface, with vLLM's names and contract.

Engine code written against vLLM's `kv_offload.abstract` ports by changing
imports. A manager only decides *where* blocks live; the data plane moves the
bytes between `prepare_*` and `complete_*` (a two-phase protocol, so a store in
flight is never readable and a block being read is never evicted).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvtier.types import BlockHash


def block_hash_list(call: str, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
    """The hashes as a list (a list is not copied); ValueError naming the first non-bytes.

    Every manager checks keys before it changes anything: a str or int key would
    otherwise be stored (and fail later, in the data plane or on disk) or raise half
    way through a call. The check is one C-level `bytes.join` (it refuses anything
    that is not bytes-like), a few times cheaper than testing each key's type.
    """
    hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
    try:
        _join(hashes)
    except TypeError:
        for block_hash in hashes:
            if not isinstance(block_hash, bytes):
                raise ValueError(
                    f"{call}: a block hash must be bytes (a BlockHash), got "
                    f"{block_hash!r} of type {type(block_hash).__name__}"
                ) from None
    return hashes


_join = b"".join


def unique_hashes(hashes: list[BlockHash]) -> list[BlockHash]:
    """Each hash once, in order of first listing (`hashes` itself when none repeats).

    vLLM accepts a hash listed twice in one call; the managers take it once (a
    second slot for the same block would leak the first, a second completion would
    free a slot twice), see docs/vllm-differences.md.
    """
    if len(hashes) < 2 or len(set(hashes)) == len(hashes):
        return hashes
    return list(dict.fromkeys(hashes))


class LoadStoreSpec(ABC):
    """Where the bytes of some blocks live in one medium (slot ids, file names...)."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium's name, as it appears in events ("CPU", "DISK", "REMOTE")."""


@dataclass
class PrepareStoreOutput:
    block_hashes_to_store: list[BlockHash]
    store_spec: LoadStoreSpec
    block_hashes_evicted: list[BlockHash]


@dataclass
class OffloadingEvent:
    block_hashes: list[BlockHash]
    block_size: int
    medium: str
    # True when the blocks were removed, False when they were stored.
    removed: bool


class OffloadingManager(ABC):
    @abstractmethod
    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        """Number of leading hashes present and ready; None means "ask again later"."""

    @abstractmethod
    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        """Pin the blocks (all must be present and ready) and say where they are."""

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Mark the blocks as recently used (applied in reverse order)."""
        return None

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        """Unpin blocks pinned by `prepare_load`."""
        return None

    @abstractmethod
    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """Reserve slots for the absent hashes, evicting if needed; None if impossible."""

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Make stored blocks readable, or on failure drop them and free their slots."""
        return None

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Yield the recorded events in order, forgetting them."""
        return ()


def reset_tier(manager: OffloadingManager) -> list[BlockHash]:
    """`manager.reset_cache()` (the keys it forgot), or a TypeError naming a manager
    that cannot reset (a reset must never leave a tier silently serving old blocks)."""
    reset = getattr(manager, "reset_cache", None)
    if reset is None:
        raise TypeError(f"{type(manager).__name__} has no reset_cache(); it cannot be reset")
    removed: list[BlockHash] = reset()
    return removed


class RecordedEvents:
    """`take_events` for a manager that records into `self.events` (None: events off).

    The recorded events are handed out in order and forgotten at once, consumed or
    not: a caller that drops the iterator does not see them again.
    """

    events: list[OffloadingEvent] | None

    def take_events(self) -> Iterator[OffloadingEvent]:
        events = self.events
        if not events:
            return iter(())
        self.events = []
        return iter(events)
