"""Model-based test of the shared disk tier: engines of 1, 2 and 4 workers on one
directory writing, evicting, reopening and reading blocks while heads go bad.

The model keeps each file's state (which heads are corrupt) and who owns it. A worker's
read must return the block's exact bytes or fail; it must succeed exactly when some
grouping (its own first, then fewest files first) has every file covering its heads
present with those heads intact; a refused file is deleted.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.remote.head_codec import HeadGroup, header_size
from kvtier.store.protocol import BlockLoadError
from kvtier.store.shared_dir import file_name, probe, shared_directory
from kvtier.types import int_block_hash
from tests.store.shared_engines import PAGES, PIECE, SHARED, TOTAL, engine, read, row, write

SIZES = (4, 2, 1)  # heads a worker: engines of 1, 2 and 4 workers
ORDER = {4: (4, 2, 1), 2: (2, 4, 1), 1: (1, 4, 2)}  # what `group_sizes` gives
blocks = st.integers(0, 2)
sizes = st.sampled_from(SIZES)


class SharedDiskMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvtier-shared-model-"))
        self.directory = shared_directory(self.root, SHARED)
        self.engines = {size: engine(self.root, size, blocks=6, fsync=False) for size in SIZES}
        # (block, group) -> the heads corrupted in that file
        self.files: dict[tuple[int, HeadGroup], set[int]] = {}

    def teardown(self) -> None:
        for stores in self.engines.values():
            for store in stores:
                store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(size=sizes, block=blocks)
    def write(self, size: int, block: int) -> None:
        stores = self.engines[size]
        write(stores, block)
        for store in stores:
            self.files[block, store.group] = set()

    @rule(size=sizes, block=blocks)
    def evict(self, size: int, block: int) -> None:
        for store in self.engines[size]:
            if int_block_hash(block) in store:
                self.files.pop((block, store.group), None)
            store.discard([int_block_hash(block)])

    @rule(data=st.data())
    def corrupt_a_head(self, data: st.DataObject) -> None:
        if not self.files:
            return
        block, group = data.draw(st.sampled_from(sorted(self.files, key=repr)))
        head = data.draw(st.sampled_from(list(group.heads)))
        path = self.directory / file_name(int_block_hash(block), group)
        raw = bytearray(path.read_bytes())
        offset = header_size(group.count) + (head - group.first) * PAGES * PIECE
        raw[offset + data.draw(st.integers(0, PAGES * PIECE - 1))] ^= 0x40
        path.write_bytes(raw)
        self.files[block, group].add(head)

    @rule(size=sizes)
    def reopen(self, size: int) -> None:
        for store in self.engines[size]:
            store.close()
        self.engines[size] = engine(self.root, size, blocks=6, fsync=False)

    @rule(size=sizes, block=blocks)
    def read(self, size: int, block: int) -> None:
        for store in self.engines[size]:
            expected = self._serves(store.group, block)
            try:
                got = read(store, block)
            except BlockLoadError:
                assert not expected, (store.group, block, self.files)
            else:
                assert expected, (store.group, block, self.files)
                assert got == row(block, store.group)

    def _serves(self, want: HeadGroup, block: int) -> bool:
        """What the store must answer, and the files it deletes on the way."""
        for size in ORDER[want.count]:
            first = want.first // size * size
            for start in range(first, want.end, size):
                group = HeadGroup(start, size)
                bad = self.files.get((block, group))
                if bad is None:
                    break
                read_heads = group.heads if group == want else set(group.heads) & set(want.heads)
                if bad & set(read_heads):
                    del self.files[block, group]  # refused: deleted
                    break
            else:
                return True
        return False

    @invariant()
    def lookups_see_what_is_on_disk(self) -> None:
        for block in range(3):
            whole = any(
                all((block, HeadGroup(f, size)) in self.files for f in range(0, TOTAL, size))
                for size in SIZES
            )
            assert probe(self.directory, int_block_hash(block), TOTAL, 2) == whole

    @invariant()
    def no_store_counts_more_than_its_budget(self) -> None:
        for stores in self.engines.values():
            for store in stores:
                assert store.stats().used_bytes <= store.capacity_bytes


TestSharedDisk = SharedDiskMachine.TestCase
TestSharedDisk.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
