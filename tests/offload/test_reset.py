"""`reset_cache`: every tier forgets every block, pinned and in flight included.

vLLM calls it on `reset_prefix_cache(reset_connector=True)` after a weight update; a
block of before served after it is KV of the old weights, served silently.
"""

from __future__ import annotations

import pytest

from kvtier.offload import CPUOffloadingManager, FilterReusedOffloadingManager
from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.offload.disk_manager import DiskOffloadingManager
from kvtier.offload.policies import available_policies
from kvtier.types import BlockHash


def hashes(n: int, start: int = 0) -> list[BlockHash]:
    return [BlockHash(i.to_bytes(8, "big")) for i in range(start, start + n)]


@pytest.mark.parametrize("policy", available_policies())
def test_a_reset_forgets_ready_pinned_and_in_flight_blocks(policy: str) -> None:
    cpu = CPUOffloadingManager(16, 8, cache_policy=policy, enable_events=True)
    ready, pinned, flying = hashes(3), hashes(2, 3), hashes(2, 5)
    for group in (ready, pinned):
        out = cpu.prepare_store(group)
        assert out is not None
        cpu.complete_store(group)
    cpu.prepare_load(pinned)
    assert cpu.prepare_store(flying) is not None  # never completed
    list(cpu.take_events())

    removed = cpu.reset_cache()

    assert sorted(removed) == sorted(ready + pinned + flying)
    assert cpu.lookup(ready + pinned + flying) == 0 and len(cpu) == 0
    assert all(h not in cpu for h in removed)
    assert cpu.backend.get_num_free_blocks() == 8
    (event,) = cpu.take_events()
    assert event.removed and sorted(event.block_hashes) == sorted(removed)
    # the tier works as before: every slot can be taken again, each once
    again = hashes(8, 100)
    out = cpu.prepare_store(again)
    assert out is not None and sorted(out.store_spec.block_ids.tolist()) == list(range(8))
    cpu.complete_store(again)
    assert cpu.lookup(again) == 8


def test_a_cascade_reset_frees_both_tiers_and_hands_the_disk_files_over() -> None:
    freed: list[BlockHash] = []
    cpu = CPUOffloadingManager(16, 2, enable_events=True)
    disk = DiskOffloadingManager(16, 8, enable_events=True, on_free=freed.extend)
    cascade = CascadeOffloadingManager(
        cpu, FilterReusedOffloadingManager(disk, 1, count_store_offers=True), enable_events=True
    )
    stored = hashes(5)
    for block_hash in stored:  # one at a time: each eviction demotes to disk
        out = cascade.prepare_store([block_hash])
        assert out is not None
        cascade.complete_store(out.block_hashes_to_store)
    on_disk = [h for h in stored if h in disk]
    assert on_disk and cascade.lookup(stored) == 5
    list(cascade.take_events())

    removed = cascade.reset_cache()

    assert sorted(removed) == sorted(stored)
    assert cascade.lookup(stored) == 0
    assert sorted(freed) == sorted(on_disk)  # the files to delete
    media = {e.medium for e in cascade.take_events() if e.removed}
    assert media == {"CPU", "DISK"}
    out = cascade.prepare_store(stored[:1])
    assert out is not None and out.block_hashes_to_store == stored[:1]


def test_a_manager_that_cannot_reset_says_so() -> None:
    from kvtier.offload.abstract import reset_tier
    from kvtier.offload.policies.base import CachePolicy

    class Bare(CachePolicy):
        def get(self, key: BlockHash) -> None:
            return None

        def insert(self, key: BlockHash, block: object) -> None: ...

        def remove(self, key: BlockHash) -> None: ...

        def touch(self, keys: object) -> None: ...

        def evict_split(self, n: int, protected: object) -> None:
            return None

    from kvtier.offload.policy_manager import PolicyOffloadingManager

    manager = PolicyOffloadingManager(CPUOffloadingManager(16, 1).backend, Bare(1))
    with pytest.raises(NotImplementedError, match="Bare does not list its keys"):
        manager.reset_cache()
    with pytest.raises(TypeError, match="object has no reset_cache"):
        reset_tier(object())  # type: ignore[arg-type]
