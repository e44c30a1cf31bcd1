"""Model-based test of the disk store: writes, reads, discards, corruption and reopens."""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.store.disk_store import DiskStore
from kvtier.store.diskformat import file_name
from kvtier.store.layout import KVLayout
from kvtier.store.protocol import BlockLoadError
from kvtier.types import BlockHash, int_block_hash

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=8, block_size=2, dtype="uint8")
CAPACITY_BLOCKS = 5
ids = st.integers(0, 9)


class DiskStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvtier-disk-model-"))
        self.store = self._open()
        self.model: dict[BlockHash, bytes] = {}
        self.version = 0

    def _open(self) -> DiskStore:
        capacity = DiskStore.capacity_for(LAYOUT, CAPACITY_BLOCKS)
        return DiskStore(self.root, LAYOUT, capacity, parallel_min_bytes=0)  # jobs in parallel

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _payload(self) -> bytes:
        self.version += 1
        return random.Random(self.version).randbytes(LAYOUT.bytes_per_block)

    @rule(blocks=st.lists(ids, unique=True, min_size=1, max_size=3))
    def write(self, blocks: list[int]) -> None:
        hashes = [int_block_hash(i) for i in blocks]
        payloads = [self._payload() for _ in hashes]
        new = [h for h in hashes if h not in self.model]
        try:
            self.store.write(hashes, payloads)
        except OSError:
            assert len(self.model) + len(new) > CAPACITY_BLOCKS  # only a full tier refuses
            return
        self.model.update(zip(hashes, payloads, strict=True))

    @rule(block=ids)
    def read(self, block: int) -> None:
        block_hash = int_block_hash(block)
        buffer = bytearray(LAYOUT.bytes_per_block)
        try:
            self.store.read([block_hash], [memoryview(buffer)])
        except BlockLoadError:
            assert block_hash not in self.model
            return
        assert bytes(buffer) == self.model[block_hash]

    @rule(blocks=st.lists(ids, unique=True, min_size=2, max_size=4))
    def read_many(self, blocks: list[int]) -> None:
        """One job of several blocks (spread over the store's I/O threads)."""
        hashes = [int_block_hash(i) for i in blocks]
        buffers = [bytearray(LAYOUT.bytes_per_block) for _ in hashes]
        try:
            self.store.read(hashes, [memoryview(b) for b in buffers])
        except BlockLoadError:
            assert any(h not in self.model for h in hashes)
            return
        assert [bytes(b) for b in buffers] == [self.model[h] for h in hashes]

    @rule(blocks=st.lists(ids, max_size=3))
    def discard(self, blocks: list[int]) -> None:
        hashes = [int_block_hash(i) for i in blocks]
        self.store.discard(hashes)
        for block_hash in hashes:
            self.model.pop(block_hash, None)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), offset=st.integers(0, LAYOUT.bytes_per_block - 1))
    def corrupt(self, data: st.DataObject, offset: int) -> None:
        block_hash = data.draw(st.sampled_from(sorted(self.model)))
        path = self.store.directory / file_name(block_hash)
        raw = bytearray(path.read_bytes())
        raw[-LAYOUT.bytes_per_block + offset] ^= 0x80
        path.write_bytes(bytes(raw))
        buffer = bytearray(LAYOUT.bytes_per_block)
        try:
            self.store.read([block_hash], [memoryview(buffer)])
        except BlockLoadError:
            del self.model[block_hash]
            assert block_hash in self.store.take_dropped()
            return
        raise AssertionError("a flipped payload bit was served")

    @rule()
    def reopen(self) -> None:
        self.store.close()  # a restart: the old owner is gone
        self.store = self._open()
        assert set(self.store.recovered) == set(self.model)

    @invariant()
    def accounting(self) -> None:
        stats = self.store.stats()
        assert stats.num_blocks == len(self.model)
        assert stats.used_bytes == sum(self.store.file_bytes(h) for h in self.model)
        assert stats.used_bytes <= self.store.capacity_bytes


TestDiskStoreModel = DiskStoreMachine.TestCase
TestDiskStoreModel.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
