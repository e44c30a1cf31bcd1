"""The offloading-manager interface, with vLLM's names and contract.

Engine code written against vLLM's `kv_offload.abstract` ports by changing
imports. A manager only decides *where* blocks live; the data plane moves the
bytes between `prepare_*` and `complete_*` (a two-phase protocol, so a store in
flight is never readable and a block being read is never evicted).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.types import BlockHash


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
