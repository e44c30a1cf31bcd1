"""`StoreCopy`: a store's blocks leave the engine's memory exactly once, copied by the
store's own thread when it starts, or by a flush that comes first; either way the
medium gets the bytes as they were when the flush returned, and the copy that failed
is never replaced by the engine's newer bytes."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.store.layout import KVLayout
from kvtier.transfer.device import DeviceKV
from kvtier.transfer.handlers import StagedHandler, StoreCopy
from tests.transfer.helpers import LAYOUTS, DictStore, block_bytes, hashes, random_kv


def overwrite(kv: DeviceKV, ids: list[int]) -> None:
    for seg in kv.segments:
        seg[ids] = 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=["per_layer", "cross_layer"])
def test_the_stores_thread_copies_when_nothing_flushed_first(layout: KVLayout) -> None:
    kv = random_kv(layout, num_blocks=6, seed=1)
    store = DictStore(kv.layout)
    handler = StagedHandler(kv, store)
    ids = np.array([1, 4], dtype=np.int64)
    expected = [block_bytes(kv, 1), block_bytes(kv, 4)]
    spec = hashes(10, 11)
    copy = StoreCopy(handler, ids)
    spec.staged = copy  # type: ignore[attr-defined]
    handler.store(ids, spec, None)
    assert copy.staging is None  # the thread's own rows, not a flush's
    assert not copy.claim()  # claimed by the store: a later flush has nothing to copy
    copy.free()  # and returns at once
    assert [store.blocks[h] for h in spec.block_hashes] == expected
    assert spec.staged is None  # type: ignore[attr-defined]  # nothing kept once written


@pytest.mark.parametrize("layout", LAYOUTS, ids=["per_layer", "cross_layer"])
def test_a_flush_first_copies_and_the_store_writes_that_copy(layout: KVLayout) -> None:
    kv = random_kv(layout, num_blocks=6, seed=2)
    store = DictStore(kv.layout)
    handler = StagedHandler(kv, store)
    ids = np.array([0, 3, 5], dtype=np.int64)
    expected = [block_bytes(kv, i) for i in (0, 3, 5)]
    spec = hashes(20, 21, 22)
    copy = StoreCopy(handler, ids)
    spec.staged = copy  # type: ignore[attr-defined]
    copy.free()  # the flush: the engine may now reuse the blocks
    overwrite(kv, [0, 3, 5])
    handler.store(ids, spec, None)
    assert [store.blocks[h] for h in spec.block_hashes] == expected


def test_a_failed_flush_copy_fails_the_store_instead_of_writing_new_bytes() -> None:
    kv = random_kv(LAYOUTS[0], num_blocks=4, seed=3)
    store = DictStore(kv.layout)
    handler = StagedHandler(kv, store)
    ids = np.array([2], dtype=np.int64)

    class Broken(StagedHandler):
        def snapshot(self, device_ids: np.ndarray) -> object:  # type: ignore[override]
            raise MemoryError("no host memory for the copy")

    copy = StoreCopy(Broken(kv, store), ids)
    with pytest.raises(MemoryError):
        copy.free()
    spec = hashes(30)
    spec.staged = copy  # type: ignore[attr-defined]
    overwrite(kv, [2])
    with pytest.raises(RuntimeError, match="copy of a 1-block store failed"):
        handler.store(ids, spec, None)
    assert store.blocks == {}


def test_a_copy_is_claimed_once() -> None:
    kv = random_kv(LAYOUTS[0], num_blocks=2, seed=4)
    copy = StoreCopy(StagedHandler(kv, DictStore(kv.layout)), np.array([0], dtype=np.int64))
    assert copy.claim()
    assert not copy.claim()
    copy.freed()
    copy.free()  # the claimer said it is done: nothing to wait for
    assert copy.staging is None
