"""Load/store specs for media addressed by slot ids."""

from __future__ import annotations

from abc import ABC
from typing import Self

import numpy as np
import numpy.typing as npt

from kvtier.offload.abstract import LoadStoreSpec


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """Blocks addressed by integer slot ids, in the order of the hashes they serve."""

    def __init__(self, block_ids: list[int] | npt.NDArray[np.int64]) -> None:
        self.block_ids: npt.NDArray[np.int64] = np.asarray(block_ids, dtype=np.int64)

    @classmethod
    def of_array(cls, block_ids: npt.NDArray[np.int64]) -> Self:
        """A spec over an int64 array the caller just built (skips `np.asarray`: hot path)."""
        spec = cls.__new__(cls)
        spec.block_ids = block_ids
        return spec

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
