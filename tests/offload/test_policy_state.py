"""The policies' whole internal state against the vLLM reference port, after every call.

The output-level differential test only sees a divergence once it changes a
decision; this one compares the orders themselves (T1, T2, both ghost lists, the
ARC target, the LRU order) so a batched fast path that reorders a single block is
caught at once. Touches here may repeat a hash and mix ghosts of both lists.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvtier.offload import CPUOffloadingManager
from kvtier.types import BlockHash, int_block_hash
from tests.reference.vllm_offload import ReferenceCPUOffloadingManager


def _state(manager: Any) -> Any:
    """Every ordering a policy keeps, least recent first, in a comparable form."""
    policy = manager.policy if hasattr(manager, "policy") else manager._policy
    if hasattr(policy, "b1"):
        if hasattr(policy, "t1"):  # the reference
            t1, t2 = list(policy.t1), list(policy.t2)
        else:
            t1, t2 = policy.keys()
        ghosts = (_ghost_keys(policy.b1), _ghost_keys(policy.b2))
        return t1, t2, ghosts, policy.target_t1_size
    return list(policy.blocks) if hasattr(policy, "blocks") else policy.keys()


def _ghost_keys(ghost: Any) -> list[BlockHash]:
    keys = getattr(ghost, "keys_in_order", None)
    return list(keys() if keys is not None else ghost)


def _step(rng: random.Random, ours: Any, ref: Any, universe: int, pinned: list[Any]) -> None:
    hashes = [int_block_hash(rng.randrange(universe)) for _ in range(rng.randint(0, 8))]
    op = rng.randrange(6)
    if op <= 1:  # duplicates allowed: a touch may repeat a hash
        ours.touch(hashes)
        ref.touch(hashes)
        return
    distinct = list(dict.fromkeys(hashes))
    if op == 2:
        n = ours.lookup(distinct)
        assert n == ref.lookup(distinct)
        if n and rng.random() < 0.5:
            ours.prepare_load(distinct[:n])
            ref.prepare_load(distinct[:n])
            pinned.append(distinct[:n])
    elif op == 3 and pinned:
        batch = pinned.pop(rng.randrange(len(pinned)))
        ours.complete_load(batch)
        ref.complete_load(batch)
    else:
        out, ref_out = ours.prepare_store(distinct), ref.prepare_store(distinct)
        assert (out is None) == (ref_out is None)
        if out is not None and rng.random() < 0.9:  # some stores stay in flight
            success = rng.random() < 0.9
            ours.complete_store(out.block_hashes_to_store, success)
            ref.complete_store(ref_out.block_hashes_to_store, success)
            assert out.block_hashes_evicted == ref_out.block_hashes_evicted


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(4))
def test_internal_orders_match_reference(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = rng.choice([4, 8, 16])
    ours = CPUOffloadingManager(16, num_blocks, policy)
    ref = ReferenceCPUOffloadingManager(16, num_blocks, policy)
    pinned: list[Any] = []
    for step in range(2000):
        _step(rng, ours, ref, num_blocks * 3, pinned)
        assert _state(ours) == _state(ref), f"step {step}"


def test_touch_with_repeats_and_both_ghost_lists() -> None:
    """One touch that repeats T1, T2 and ghost hashes, B1 and B2 interleaved."""
    ours = CPUOffloadingManager(16, 4, "arc")
    ref = ReferenceCPUOffloadingManager(16, 4, "arc")
    h = [int_block_hash(i) for i in range(12)]
    script: list[tuple[str, list[BlockHash]]] = [
        ("store", h[0:4]),
        ("touch", [h[0], h[1]]),  # to T2
        ("store", h[4:6]),  # evicts from T1 -> B1
        ("touch", [h[4], h[5]]),
        ("store", h[6:8]),  # evicts from T2 -> B2
        ("touch", [h[2], h[0], h[6], h[2], h[1], h[7], h[6], h[3], h[0], h[2]]),
    ]
    for name, hashes in script:
        for manager in (ours, ref):
            if name == "touch":
                manager.touch(hashes)
            else:
                out = manager.prepare_store(hashes)
                assert out is not None
                manager.complete_store(out.block_hashes_to_store)
        assert _state(ours) == _state(ref), name
