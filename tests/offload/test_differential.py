"""kvtier's managers against the vLLM reference port: same inputs, same outputs.

Random operation sequences (seeded) exercise pins, in-flight stores, failures and
protected blocks; the real trace exercises the replay the benchmarks time.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvtier.offload import CPUOffloadingManager, PrepareStoreOutput
from kvtier.sim.traces import TraceRequest
from kvtier.types import BlockHash, int_block_hash
from tests.reference.vllm_offload import ReferenceCPUOffloadingManager


def _store_output(out: PrepareStoreOutput | None) -> Any:
    if out is None:
        return None
    ids = out.store_spec.block_ids.tolist()  # type: ignore[attr-defined]
    return (list(out.block_hashes_to_store), ids, list(out.block_hashes_evicted))


def _events(manager: Any) -> list[tuple[list[BlockHash], int, str, bool]]:
    return [
        (list(e.block_hashes), e.block_size, e.medium, e.removed) for e in manager.take_events()
    ]


class _Pair:
    """Drives both managers with the same call and checks the same answer."""

    def __init__(self, policy: str, num_blocks: int) -> None:
        self.ours = CPUOffloadingManager(16, num_blocks, policy, enable_events=True)
        self.ref = ReferenceCPUOffloadingManager(16, num_blocks, policy, enable_events=True)
        self.ready: set[BlockHash] = set()
        self.in_flight: list[list[BlockHash]] = []
        self.pinned: list[list[BlockHash]] = []

    def both(self, name: str, *args: Any) -> Any:
        ours = getattr(self.ours, name)(*args)
        ref = getattr(self.ref, name)(*args)
        if name == "prepare_store":
            ours, ref = _store_output(ours), _store_output(ref)
        elif name == "prepare_load":
            ours, ref = ours.block_ids.tolist(), ref.block_ids.tolist()
        assert ours == ref, f"{name}{args}: {ours} != {ref}"
        return ours

    def step(self, rng: random.Random, universe: int) -> None:
        op = rng.randrange(7)
        hashes = [int_block_hash(h) for h in rng.sample(range(universe), rng.randint(0, 6))]
        if op == 0:
            self.both("lookup", hashes)
        elif op == 1:
            self.both("touch", hashes)
        elif op == 2 and self.ready:
            k = min(len(self.ready), rng.randint(1, 4))
            load = rng.sample(sorted(self.ready), k)
            self.both("prepare_load", load)
            self.pinned.append(load)
        elif op == 3 and self.pinned:
            self.both("complete_load", self.pinned.pop(rng.randrange(len(self.pinned))))
        elif op in (4, 5):
            out = self.both("prepare_store", hashes)
            if out is not None:
                self.ready.difference_update(out[2])
                self.in_flight.append(out[0])
        elif op == 6 and self.in_flight:
            batch = self.in_flight.pop(rng.randrange(len(self.in_flight)))
            success = rng.random() < 0.8
            self.both("complete_store", batch, success)
            if success:
                self.ready.update(h for h in batch if self.ours.get_block(h) is not None)
            self.ready = {h for h in self.ready if h in self.ours}
        assert _events(self.ours) == _events(self.ref)


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_reference(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = rng.choice([2, 4, 8, 16])
    pair = _Pair(policy, num_blocks)
    for _ in range(3000):
        pair.step(rng, universe=num_blocks * 3)


def replay(manager: Any, requests: list[TraceRequest]) -> tuple[int, int]:
    """The issue's replay: lookup, load the hits, touch all, store the rest."""
    hits = total = 0
    for request in requests:
        hashes = [int_block_hash(h) for h in request.hash_ids]
        n = manager.lookup(hashes)
        if n:
            manager.prepare_load(hashes[:n])
            manager.complete_load(hashes[:n])
        manager.touch(hashes)
        rest = hashes[n:]
        out = manager.prepare_store(rest)
        if out is not None:
            manager.complete_store(out.block_hashes_to_store)
        hits += n
        total += len(hashes)
    return hits, total
