"""Model-based test of the manager: random interleavings, invariants after every step.

Prompts come from a two-token alphabet with tiny blocks, so prefixes collide all the
time; requests are built from tokens or from precomputed hashes. After each step:
every block is in use or in the free queue exactly once, reference counts equal the
number of block tables holding a block, the hash index only names blocks carrying that
hash, free + used == pool size, replaying the events reproduces the index, and hits
never exceed what is actually cached.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtier import KVCacheManager, Request
from kvtier.gpu import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.hashing import hash_request_blocks
from tests.pool.helpers import allocate, append, snapshot

BLOCK_SIZE = 2
MAX_MODEL_LEN = 14


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager
        self.running: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}
        self.count = 0
        self.event_mirror: Counter[bytes] = Counter()

    @initialize(
        num_blocks=st.integers(3, 9),
        prealloc=st.sampled_from([0, 2]),
        window=st.sampled_from([None, None, 3, 5]),
    )
    def setup(self, num_blocks: int, prealloc: int, window: int | None) -> None:
        self.manager = KVCacheManager(
            BLOCK_SIZE,
            num_blocks,
            MAX_MODEL_LEN,
            sliding_window=window,
            num_preallocate_tokens=prealloc,
            enable_kv_cache_events=True,
        )

    def ids(self) -> list[str]:
        return [*self.running, *self.waiting]

    # --- rules ----------------------------------------------------------------------

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=10), by_hash=st.booleans())
    def new_request(self, tokens: list[int], by_hash: bool) -> None:
        self.count += 1
        request_id = f"r{self.count}"
        if by_hash:
            hashes = hash_request_blocks(tokens, BLOCK_SIZE)
            request = Request.from_block_hashes(
                request_id, hashes, len(tokens), block_size=BLOCK_SIZE
            )
        else:
            request = Request(request_id, tokens)
        self.waiting[request_id] = request

    @precondition(lambda self: any(r.has_token_ids for r in self.running.values()))
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 1), max_size=4))
    def fork(self, data: st.DataObject, suffix: list[int]) -> None:
        """A new request sharing a running one's tokens (so blocks get shared)."""
        ids = sorted(r for r, req in self.running.items() if req.has_token_ids)
        parent = self.running[data.draw(st.sampled_from(ids))]
        tokens = [*parent.all_token_ids, *suffix][: MAX_MODEL_LEN - 1]
        self.count += 1
        self.waiting[f"r{self.count}"] = Request(f"r{self.count}", tokens)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule(self, data: st.DataObject) -> None:
        request = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        blocks, hit = self.manager.get_computed_blocks(request)
        self.check_hit(request, blocks, hit)
        before = snapshot(self.manager, self.ids())
        new = allocate(self.manager, request, request.num_tokens - hit, blocks)
        if new is None:
            assert snapshot(self.manager, self.ids()) == before
            return
        assert request.num_computed_tokens == request.num_tokens
        self.running[request.request_id] = self.waiting.pop(request.request_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 1))
    def decode(self, data: st.DataObject, token: int) -> None:
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.num_tokens < MAX_MODEL_LEN:
            request.append_output_token_ids(token)
        if request.num_computed_tokens == request.num_tokens:
            return
        computed = request.num_computed_tokens
        before = snapshot(self.manager, self.ids())
        new = append(self.manager, request, request.num_tokens - computed)
        if new is None:
            assert snapshot(self.manager, self.ids()) == before
            assert request.num_computed_tokens == computed
        else:
            assert request.num_computed_tokens == request.num_tokens

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data: st.DataObject, preempt: bool) -> None:
        request = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        if preempt:
            self.manager.preempt(request)
            assert request.num_computed_tokens == 0
            self.waiting[request.request_id] = request
        else:
            self.manager.free(request)
        before = snapshot(self.manager, self.ids())
        self.manager.free(request)  # freed already: nothing to do (the seed's rule)
        assert snapshot(self.manager, self.ids()) == before

    @rule()
    def reset(self) -> None:
        assert self.manager.reset_prefix_cache() == (not self.running)

    # --- checks ---------------------------------------------------------------------

    def check_hit(self, request: Request, blocks: list[Any], hit: int) -> None:
        hashes = request.get_block_hashes(BLOCK_SIZE, "sha256_cbor")
        assert hit == len(blocks) * BLOCK_SIZE and hit < request.num_tokens
        for i, block in enumerate(blocks):
            assert block.is_null or block.block_hash == hashes[i]
        if blocks:
            assert not blocks[-1].is_null
        pool = self.manager.block_pool
        leading = 0
        while leading < len(hashes) and hashes[leading] in pool:
            leading += 1
        cap = (request.num_tokens - 1) // BLOCK_SIZE
        if self.manager.sliding_window is None:
            assert len(blocks) == min(leading, cap)
        else:
            assert len(blocks) <= cap

    @invariant()
    def blocks_in_use_or_free_exactly_once(self) -> None:
        pool = self.manager.block_pool
        in_queue = Counter(b.block_id for b in pool.free_block_queue)
        holders = Counter(
            b.block_id for r in self.running for b in self.manager.get_blocks(r) if not b.is_null
        )
        for block in pool.blocks:
            if block.is_null:
                assert block.block_id not in in_queue
                continue
            assert block.ref_cnt == holders[block.block_id]
            assert in_queue[block.block_id] == (1 if block.ref_cnt == 0 else 0)
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0 or b.is_null)
        assert pool.get_num_free_blocks() + used == pool.num_gpu_blocks

    @invariant()
    def index_names_only_its_blocks(self) -> None:
        pool = self.manager.block_pool
        indexed = 0
        for block_hash, blocks in pool.cached_items():
            assert blocks
            for block in blocks:
                assert block.block_hash == block_hash and not block.is_null
            indexed += len(blocks)
        assert indexed == sum(1 for b in pool.blocks if b.block_hash is not None)

    @invariant()
    def events_replay_to_the_index(self) -> None:
        for event in self.manager.take_events():
            if isinstance(event, BlockStored):
                self.event_mirror.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.event_mirror.subtract(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.event_mirror.clear()
        self.event_mirror = +self.event_mirror
        pool = self.manager.block_pool
        assert self.event_mirror == Counter({h: len(bs) for h, bs in pool.cached_items()})

    @invariant()
    def requests_are_consistent(self) -> None:
        assert set(self.running) == {r for r in self.ids() if self.manager.has_request(r)}
        for request in self.running.values():
            hashes = request.get_block_hashes(BLOCK_SIZE, "sha256_cbor")
            blocks = self.manager.get_blocks(request.request_id)
            num_cached = self.manager.get_num_cached_blocks(request.request_id)
            assert len(blocks) * BLOCK_SIZE >= request.num_computed_tokens  # room for all
            assert len(blocks) <= -(-MAX_MODEL_LEN // BLOCK_SIZE)
            assert num_cached <= min(len(hashes), len(blocks))
            for i in range(num_cached):
                assert blocks[i].is_null or blocks[i].block_hash == hashes[i]
        stats = self.manager.prefix_cache_stats
        assert stats.hit_tokens <= stats.queried_tokens
        assert stats.hit_blocks <= stats.queried_blocks


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
