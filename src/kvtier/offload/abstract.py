"""The offloading-manager interface, with vLLM's names and contract.

Engine code written against vLLM's `kv_offload.abstract` ports by changing
imports. A manager only decides *where* blocks live; the data plane moves the
bytes between `prepare_*` and `complete_*` (a two-phase protocol, so a store in
flight is never readable and a block being read is never evicted).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvtier.types import BlockHash


def distinct_hashes(call: str, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
    """The hashes as a list (a list is not copied); ValueError naming the repeats if any.

    Every manager refuses a hash listed twice in one pin or reservation call, with
    the same error: one such block would otherwise be pinned or reserved twice.
    """
    hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
    if len(set(hashes)) != len(hashes):
        dups = [h for h, n in Counter(hashes).items() if n > 1]
        raise ValueError(f"{call}: duplicate block hashes in one call: {dups!r}")
    return hashes


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
