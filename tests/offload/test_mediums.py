"""Slot-id specs: a CPU spec's ids are read only when asked for, and stay right."""

from __future__ import annotations

import pickle

import numpy as np

from kvtier.offload import CPUOffloadingManager
from kvtier.offload.backend import BlockStatus
from kvtier.offload.mediums import CPULoadStoreSpec


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_a_spec_over_blocks_reads_their_ids_when_asked() -> None:
    blocks = [BlockStatus(5), BlockStatus(2), BlockStatus(7)]
    spec = CPULoadStoreSpec.of_blocks(blocks)
    assert spec.block_ids.dtype == np.int64
    assert spec.block_ids.tolist() == [5, 2, 7]
    assert spec.block_ids is spec.block_ids  # built once
    assert repr(spec) == "CPULoadStoreSpec(block_ids=[5, 2, 7])"


def test_a_store_spec_read_after_its_slots_were_reused_names_them() -> None:
    # Slot objects are reused for their own slot: a spec read late still names the
    # slots it was planned over, even once they hold other blocks.
    manager = CPUOffloadingManager(block_size=16, num_blocks=2)
    first = manager.prepare_store([_h(1), _h(2)])
    assert first is not None
    manager.complete_store([_h(1), _h(2)])
    second = manager.prepare_store([_h(3), _h(4)])  # evicts both, takes their slots
    assert second is not None and second.block_hashes_evicted == [_h(1), _h(2)]
    assert isinstance(first.store_spec, CPULoadStoreSpec)
    assert isinstance(second.store_spec, CPULoadStoreSpec)
    assert first.store_spec.block_ids.tolist() == [0, 1]
    assert sorted(second.store_spec.block_ids.tolist()) == [0, 1]


def test_a_pickled_spec_carries_slot_ids_not_block_objects() -> None:
    spec = CPULoadStoreSpec.of_blocks([BlockStatus(3), BlockStatus(1)])
    data = pickle.dumps(spec)
    assert b"BlockStatus" not in data
    copy = pickle.loads(data)
    assert isinstance(copy, CPULoadStoreSpec)
    assert copy.block_ids.tolist() == [3, 1]
    assert CPULoadStoreSpec([4]).block_ids.tolist() == [4]
    assert pickle.loads(pickle.dumps(CPULoadStoreSpec([4]))).block_ids.tolist() == [4]
