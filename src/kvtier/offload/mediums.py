"""Load/store specs for media addressed by slot ids."""

from __future__ import annotations

from abc import ABC
from collections.abc import Sequence
from typing import Any, Protocol, Self

import numpy as np
import numpy.typing as npt

from kvtier.offload._fast import block_id
from kvtier.offload.abstract import LoadStoreSpec


class HasBlockId(Protocol):
    @property
    def block_id(self) -> int: ...


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """Blocks addressed by integer slot ids, in the order of the hashes they serve."""

    def __init__(self, block_ids: list[int] | npt.NDArray[np.int64]) -> None:
        self._ids: npt.NDArray[np.int64] | None = np.asarray(block_ids, dtype=np.int64)
        self._blocks: Sequence[HasBlockId] = ()

    @classmethod
    def of_array(cls, block_ids: npt.NDArray[np.int64]) -> Self:
        """A spec over an int64 array the caller just built (skips `np.asarray`: hot path)."""
        spec = cls.__new__(cls)
        spec._ids, spec._blocks = block_ids, ()
        return spec

    @classmethod
    def of_blocks(cls, blocks: Sequence[HasBlockId]) -> Self:
        """A spec over the slots of `blocks`, whose ids become an array only when read.

        Most specs are never read by anyone that needs the array (a replay without
        bytes, a store the data plane skips), and building it cost a third of a CPU
        store's bookkeeping. The blocks' ids must not change (a CPU slot's status
        object keeps its slot for life); the list must not be changed afterwards.
        """
        spec = cls.__new__(cls)
        spec._ids, spec._blocks = None, blocks
        return spec

    @property
    def block_ids(self) -> npt.NDArray[np.int64]:
        ids = self._ids
        if ids is None:
            blocks = self._blocks
            ids = self._ids = np.fromiter(map(block_id, blocks), np.int64, len(blocks))
            self._blocks = ()
        return ids

    def __getstate__(self) -> dict[str, Any]:
        """The ids, not the blocks: a spec sent to another process carries slot ids."""
        return {"_ids": self.block_ids, "_blocks": ()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_ids={self.block_ids.tolist()})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return "GPU"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return "CPU"
