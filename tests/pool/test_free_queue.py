"""The free-block queue: order, O(1) middle removal, and a model-based check against a list."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.gpu.block import KVCacheBlock
from kvtier.gpu.free_queue import FreeKVCacheBlockQueue


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_starts_in_id_order_and_pops_from_head() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    assert queue.popleft() is blocks[0]
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 2]
    assert ids(queue) == [3, 4]


def test_remove_from_middle_and_append_to_tail() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3]
    queue.append(blocks[2])
    assert ids(queue) == [0, 1, 3, 2]
    queue.remove(blocks[0])
    queue.appendleft(blocks[0])
    assert ids(queue) == [0, 1, 3, 2]


def test_errors_leave_queue_unchanged() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    outsider = KVCacheBlock(9)
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(outsider)
    with pytest.raises(ValueError, match="only 2 free"):
        queue.popleft_n(3)
    assert ids(queue) == [0, 1]
    queue.popleft_n(2)
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    assert len(queue) == 0 and ids(queue) == []


class FreeQueueMachine(RuleBasedStateMachine):
    """Every operation mirrored on a plain list (the obvious O(n) implementation)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = [KVCacheBlock(i) for i in range(8)]
        self.queue = FreeKVCacheBlockQueue(self.blocks)
        self.model = list(range(8))

    @precondition(lambda self: self.model)
    @rule(n=st.integers(1, 3))
    def popleft_n(self, n: int) -> None:
        n = min(n, len(self.model))
        got = [b.block_id for b in self.queue.popleft_n(n)]
        assert got == self.model[:n]
        del self.model[:n]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self.model))
        self.queue.remove(self.blocks[block_id])
        self.model.remove(block_id)

    @precondition(lambda self: len(self.model) < 8)
    @rule(data=st.data(), to_head=st.booleans())
    def put_back(self, data: st.DataObject, to_head: bool) -> None:
        outside = sorted(set(range(8)) - set(self.model))
        block_id = data.draw(st.sampled_from(outside))
        if to_head:
            self.queue.appendleft(self.blocks[block_id])
            self.model.insert(0, block_id)
        else:
            self.queue.append(self.blocks[block_id])
            self.model.append(block_id)

    @invariant()
    def same_order(self) -> None:
        assert ids(self.queue) == self.model
        assert self.queue.num_free_blocks == len(self.model)
        for block in self.blocks:
            linked = block.prev_free is not None
            assert linked == (block.block_id in self.model)


TestFreeQueueMachine = FreeQueueMachine.TestCase
TestFreeQueueMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
