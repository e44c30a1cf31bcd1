"""Model-based test of the cascade with real bytes: whatever the interleaving of stores,
loads, touches, disk write failures and completions, a load that succeeds delivers
exactly the bytes that were stored under its hashes, and nothing else."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from kvtier.store.disk_store import DiskStore
from kvtier.types import BlockHash, int_block_hash
from tests.cascade.engine import Engine
from tests.transfer.helpers import CROSS_LAYER, PER_LAYER, block_bytes

block_lists = st.lists(st.integers(0, 11), unique=True, min_size=1, max_size=4)


class FlakyDisk:
    """Makes the engine's disk store fail its writes while `failing` is set."""

    def __init__(self, store: DiskStore) -> None:
        self.failing = False
        original = store.write_parts

        def write_parts(hashes: Sequence[BlockHash], blocks: Sequence[Sequence[object]]) -> None:
            if self.failing:
                raise OSError("injected disk write failure")
            original(hashes, blocks)  # type: ignore[arg-type]

        store.write_parts = write_parts  # type: ignore[method-assign]


class CascadeBytesMachine(RuleBasedStateMachine):
    @initialize(
        per_layer=st.booleans(),
        disk_writes=st.sampled_from(["demote", "write_through"]),
        promote=st.booleans(),
        split_writes=st.booleans(),
    )
    def start(self, per_layer: bool, disk_writes: str, promote: bool, split_writes: bool) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvtier-cascade-model-"))
        layout = PER_LAYER if per_layer else CROSS_LAYER
        self.engine = Engine(
            layout,
            self.root,
            cpu_blocks=3,
            disk_blocks=5,
            disk_writes=disk_writes,
            promote=promote,
            split_writes=split_writes,
        )
        self.flaky = FlakyDisk(self.engine.disk_store)
        self.checks: list[tuple[int, BlockHash]] = []  # (target device block, hash)
        self.deferred: tuple[list[BlockHash], list[int], object] | None = None
        self.loads_ok = 0

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            self.finish()
            self.engine.close()
            shutil.rmtree(self.root, ignore_errors=True)

    @rule(blocks=block_lists)
    def store(self, blocks: list[int]) -> None:
        self.engine.store([int_block_hash(b) for b in blocks], blocks)
        self._bound_outstanding()

    @rule(blocks=block_lists)
    def store_deferred(self, blocks: list[int]) -> None:
        """Prepare a store now, submit its job later (loads may be submitted before it)."""
        self.submit_deferred()
        hashes = [int_block_hash(b) for b in blocks]
        out = self.engine.cascade.prepare_store(hashes)
        if out is not None:
            source = dict(zip(hashes, blocks, strict=True))
            ids = [source[h] for h in out.block_hashes_to_store]
            for block_hash, device_id in zip(out.block_hashes_to_store, ids, strict=True):
                self.engine.expected[block_hash] = block_bytes(self.engine.kv, device_id)
            self.deferred = (out.block_hashes_to_store, ids, out.store_spec)

    @rule()
    def submit_deferred(self) -> None:
        if self.deferred is not None:
            self.engine._submit("store", *self.deferred)
            self.deferred = None

    @rule(blocks=block_lists)
    def load_prefix(self, blocks: list[int]) -> None:
        hashes = [int_block_hash(b) for b in blocks]
        hits = self.engine.cascade.lookup(hashes)
        if hits:
            targets = self.engine.load(hashes[:hits])
            self.checks += zip(targets, hashes[:hits], strict=True)
        self._bound_outstanding()

    @rule(blocks=block_lists)
    def touch(self, blocks: list[int]) -> None:
        self.engine.cascade.touch([int_block_hash(b) for b in blocks])

    @rule(failing=st.booleans())
    def disk_failures(self, failing: bool) -> None:
        self.flaky.failing = failing

    @rule()
    def finish(self) -> None:
        self.submit_deferred()
        jobs = dict(self.engine._jobs)
        results = self.engine.results(list(jobs))
        failed_targets: set[int] = set()
        for job_id, ok in results.items():
            kind, hashes = self.engine._jobs.pop(job_id)
            if kind == "store":
                self.engine.cascade.complete_store(hashes, ok)
            else:
                self.engine.cascade.complete_load(hashes, ok)
                self.loads_ok += ok
        for job_id, (kind, _) in jobs.items():
            if kind == "load" and not results[job_id]:
                failed_targets.update(self._targets.pop(job_id, []))
        for target, block_hash in self.checks:
            if target not in failed_targets:
                expected = self.engine.expected[block_hash]
                assert block_bytes(self.engine.kv, target) == expected, (target, block_hash)
        self.checks = []
        lost = self.engine.handler.take_lost()
        if lost:
            self.engine.cascade.discard_disk_blocks(lost)

    @property
    def _targets(self) -> dict[int, list[int]]:
        return self.engine.load_targets

    def _bound_outstanding(self) -> None:
        if len(self.engine._jobs) >= 6:  # device load targets are reused after 32 blocks
            self.finish()


TestCascadeBytes = CascadeBytesMachine.TestCase
TestCascadeBytes.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
