"""The reuse filter (docs/semantics.md section 5) and its store-offer counting option."""

from __future__ import annotations

import pytest

from kvtier.offload import CPUOffloadingManager, FilterReusedOffloadingManager
from kvtier.types import BlockHash, int_block_hash


def h(*ids: int) -> list[BlockHash]:
    return [int_block_hash(i) for i in ids]


def stored(f: FilterReusedOffloadingManager, *ids: int) -> list[BlockHash]:
    out = f.prepare_store(h(*ids))
    assert out is not None
    f.complete_store(out.block_hashes_to_store)
    return out.block_hashes_to_store


def make(**kwargs: int | bool) -> FilterReusedOffloadingManager:
    return FilterReusedOffloadingManager(CPUOffloadingManager(16, 8), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"store_threshold": 0}, "store_threshold must be an integer >= 1, got 0"),
        ({"store_threshold": 2.5}, "store_threshold"),
        ({"max_tracker_size": 0}, "max_tracker_size"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_store_threshold_1_stores_what_was_looked_up_once() -> None:
    f = make(store_threshold=1)  # vLLM accepts it, so kvtier does
    f.lookup(h(1))
    assert stored(f, 1, 2) == h(1)


def test_stores_only_blocks_seen_threshold_times_in_lookups() -> None:
    f = make()
    assert f.lookup(h(1, 2)) == 0  # counts every input hash, hit or not
    assert stored(f, 1, 2) == []
    assert f.lookup(h(1, 3)) == 0
    assert stored(f, 1, 2, 3) == h(1)
    assert f.lookup(h(1)) == 1
    assert f.counters.filtered_out == 2 + 2


def test_threshold_three() -> None:
    f = make(store_threshold=3)
    f.lookup(h(1))
    f.lookup(h(1))
    assert stored(f, 1) == []
    f.lookup(h(1))
    assert stored(f, 1) == h(1)


def test_full_tracker_drops_the_least_recently_seen_hash() -> None:
    f = make(max_tracker_size=2)
    f.lookup(h(1, 2))
    f.lookup(h(1))  # 2 is now the least recently seen
    f.lookup(h(3))  # full: 2 is dropped
    assert list(f.counts) == h(1, 3)
    f.lookup(h(2))  # back at 1, dropping 1
    assert dict(f.counts) == {int_block_hash(3): 1, int_block_hash(2): 1}
    assert stored(f, 1, 2, 3) == []


def test_everything_else_is_delegated() -> None:
    backing = CPUOffloadingManager(16, 4, enable_events=True)
    f = FilterReusedOffloadingManager(backing)
    f.lookup(h(1))
    f.lookup(h(1))
    assert stored(f, 1) == h(1)
    spec = f.prepare_load(h(1))
    assert spec.block_ids.tolist() == [0]  # type: ignore[attr-defined]
    f.touch(h(1))
    f.complete_load(h(1))
    assert [e.removed for e in f.take_events()] == [False]
    out = f.prepare_store(h(1))
    assert out is not None and out.block_hashes_to_store == []  # present: nothing to do
    c = f.counters
    assert (c.lookups, c.loaded_blocks, c.stored_blocks) == (2, 1, 1)


def test_counting_store_offers_instead_of_lookups() -> None:
    f = make(count_store_offers=True)
    f.lookup(h(1, 2))
    f.lookup(h(1, 2))
    assert f.counts == {}  # lookups are not counted in this mode
    assert stored(f, 1, 2) == []  # first offer
    assert stored(f, 2, 1) == h(2, 1)  # second offer: stored, input order kept


def test_a_repeated_offer_counts_once_and_a_repeated_lookup_twice() -> None:
    f = make(count_store_offers=True)
    assert stored(f, 1, 2, 1) == []
    assert dict(f.counts) == {int_block_hash(1): 1, int_block_hash(2): 1}
    assert f.counters.filtered_out == 2
    g = make()
    g.lookup(h(1, 1))  # vLLM counts every listing of a lookup
    assert stored(g, 1) == h(1)


@pytest.mark.parametrize("count_store_offers", [False, True])
def test_a_key_that_is_not_bytes_is_refused_before_counting(count_store_offers: bool) -> None:
    f = make(count_store_offers=count_store_offers)
    f.lookup(h(1))
    before = dict(f.counts)
    for call in (f.lookup, f.prepare_store):
        with pytest.raises(ValueError, match="must be bytes"):  # refused even if filtered out
            call([*h(1, 2), "abc"])  # type: ignore[list-item]
    assert f.counts == before and f.counters.filtered_out == 0
