"""`CPUBackend`'s slot order, model-based: the exact slots each allocation returns in
both orders, and, freed slots first, never more slots used than ever held at once (a
host slot is resident from its first write: that count is the tier's memory)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.offload import CPUBackend
from kvtier.offload.backend import BlockStatus
from kvtier.types import BlockHash

CAPACITY = 12


class SlotOrder(RuleBasedStateMachine):
    @initialize(reuse_freed_first=st.booleans())
    def start(self, reuse_freed_first: bool) -> None:
        self.backend = CPUBackend(16, CAPACITY, reuse_freed_first=reuse_freed_first)
        self.reuse_freed_first = reuse_freed_first
        self.held: list[BlockStatus] = []
        self.freed: list[int] = []  # the model: freed slot ids, most recently freed last
        self.num_fresh_given = 0
        self.peak_held = 0

    def expected(self, n: int) -> list[int]:
        fresh_left = CAPACITY - self.num_fresh_given
        num_reused = min(n, len(self.freed)) if self.reuse_freed_first else n - min(n, fresh_left)
        reused = self.freed[::-1][:num_reused]
        start = self.num_fresh_given
        fresh = list(range(start, start + n - num_reused))
        return reused + fresh if self.reuse_freed_first else fresh + reused

    @rule(n=st.integers(1, 5))
    def allocate(self, n: int) -> None:
        keys = [BlockHash(bytes([i])) for i in range(n)]
        if n > CAPACITY - len(self.held):
            try:
                self.backend.allocate_blocks(keys)
            except ValueError:
                return
            raise AssertionError("allocated beyond the free slots")
        want = self.expected(n)
        got = self.backend.allocate_blocks(keys)
        assert [b.block_id for b in got] == want
        assert all(b.ref_cnt == -1 for b in got)
        reused = set(want) & set(self.freed)
        self.freed = [s for s in self.freed if s not in reused]
        self.num_fresh_given += n - len(reused)
        self.held += got
        self.peak_held = max(self.peak_held, len(self.held))

    @precondition(lambda self: self.held)
    @rule(data=st.data(), batch=st.booleans())
    def free(self, data: st.DataObject, batch: bool) -> None:
        indices = st.sampled_from(range(len(self.held)))
        picked = data.draw(st.lists(indices, min_size=1, unique=True))
        blocks = [self.held[i] for i in picked]
        self.held = [b for i, b in enumerate(self.held) if i not in set(picked)]
        if batch:
            self.backend.free_blocks(blocks)
        else:
            for block in blocks:
                self.backend.free(block)
        self.freed += [b.block_id for b in blocks]

    @invariant()
    def slots_are_distinct_and_counted(self) -> None:
        ids = [b.block_id for b in self.held]
        assert len(set(ids)) == len(ids) and all(0 <= i < CAPACITY for i in ids)
        assert self.backend.get_num_free_blocks() == CAPACITY - len(self.held)
        assert self.backend.num_used_slots == self.num_fresh_given

    @invariant()
    def freed_first_uses_no_more_slots_than_ever_held(self) -> None:
        if self.reuse_freed_first:
            assert self.backend.num_used_slots == self.peak_held


TestSlotOrder = SlotOrder.TestCase
TestSlotOrder.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_vllms_order_uses_fresh_slots_while_freed_ones_wait() -> None:
    """The difference in one case: after a free, vLLM's order takes a fresh slot."""
    keys = [BlockHash(b"a"), BlockHash(b"b")]
    for reuse_freed_first, want in ((False, [2]), (True, [1])):
        backend = CPUBackend(16, 4, reuse_freed_first=reuse_freed_first)
        _, second = backend.allocate_blocks(keys)
        backend.free(second)
        assert [b.block_id for b in backend.allocate_blocks(keys[:1])] == want
