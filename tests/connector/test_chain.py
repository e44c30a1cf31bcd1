"""The tier chain: prefix continued across tiers, promotion, write-through."""

from __future__ import annotations

import pytest

from kvtier.connector.chain import ChainSpec, TierChain
from kvtier.offload import CPUOffloadingManager
from kvtier.types import BlockHash, int_block_hash


def _h(*ids: int) -> list[BlockHash]:
    return [int_block_hash(i) for i in ids]


def _chain(top: int = 2, bottom: int = 8) -> TierChain:
    return TierChain(
        [
            ("cpu", CPUOffloadingManager(4, top, cache_policy="lru")),
            ("disk", CPUOffloadingManager(4, bottom, cache_policy="lru")),
        ]
    )


def _store(chain: TierChain, hashes: list[BlockHash]) -> None:
    out = chain.prepare_store(hashes)
    assert out is not None
    chain.complete_store(out.block_hashes_to_store)


def test_write_through_and_prefix_across_tiers() -> None:
    chain = _chain()
    _store(chain, _h(1, 2))
    _store(chain, _h(3, 4))  # the top tier (2 blocks) evicts 1, 2; the bottom keeps all
    assert chain.resident[0] == set(_h(3, 4)) and chain.resident[1] == set(_h(1, 2, 3, 4))
    assert chain.lookup(_h(1, 2, 3, 4, 5)) == 4
    spec = chain.prepare_load(_h(1, 2, 3, 4))
    assert isinstance(spec, ChainSpec)
    # The top tier misses blocks 1 and 2; 3 and 4 still come from it (the fastest tier
    # holding a block serves it, as an engine asking key by key chooses).
    parts = [(name, part) for name, part, _ in spec.parts]
    assert parts == [("disk", _h(1, 2)), ("cpu", _h(3, 4))]


def test_split_follows_the_tiers_in_order() -> None:
    chain = _chain(top=4)
    _store(chain, _h(1, 2))
    out = chain.tiers[1][1].prepare_store(_h(3))  # only the bottom tier holds 3
    assert out is not None
    chain.tiers[1][1].complete_store(out.block_hashes_to_store)
    chain.resident[1].add(int_block_hash(3))
    assert chain.lookup(_h(1, 2, 3)) == 3
    spec = chain.prepare_load(_h(1, 2, 3))
    assert isinstance(spec, ChainSpec)
    assert [(name, part) for name, part, _ in spec.parts] == [("cpu", _h(1, 2)), ("disk", _h(3))]
    chain.complete_load(_h(1, 2, 3))
    # Served from the bottom: promoted into the top tier, so the next hit is local.
    assert int_block_hash(3) in chain.resident[0]
    assert chain.tiers[0][1].lookup(_h(1, 2, 3)) == 3


def test_a_failed_load_promotes_nothing() -> None:
    chain = _chain(top=4)
    out = chain.tiers[1][1].prepare_store(_h(3))
    assert out is not None
    chain.tiers[1][1].complete_store(out.block_hashes_to_store)
    chain.resident[1].add(int_block_hash(3))
    assert chain.lookup(_h(3)) == 1
    chain.prepare_load(_h(3))
    chain.complete_load(_h(3), success=False)  # its bytes never arrived: nothing to copy up
    assert chain.tiers[0][1].lookup(_h(3)) == 0 and int_block_hash(3) not in chain.resident[0]


def test_rejections_are_counted_per_tier() -> None:
    chain = _chain(top=1, bottom=8)
    out = chain.prepare_store(_h(1, 2))  # two blocks do not fit the top tier; the bottom takes them
    assert out is not None and out.block_hashes_to_store == _h(1, 2)
    assert chain.rejections == {"cpu": 1}


def test_evicted_means_gone_from_every_tier() -> None:
    chain = _chain(top=1, bottom=2)
    _store(chain, _h(1))
    out = chain.prepare_store(_h(2))
    assert out is not None and out.block_hashes_evicted == []  # 1 is still at the bottom
    chain.complete_store(out.block_hashes_to_store)
    out = chain.prepare_store(_h(3))
    assert out is not None and out.block_hashes_evicted == _h(1)
    chain.complete_store(out.block_hashes_to_store)


def test_failed_store_leaves_nothing_readable() -> None:
    chain = _chain()
    out = chain.prepare_store(_h(1))
    assert out is not None
    chain.complete_store(out.block_hashes_to_store, success=False)
    assert chain.lookup(_h(1)) == 0


def test_a_refused_load_unpins_the_parts_before_it() -> None:
    class Refusing(CPUOffloadingManager):
        def prepare_load(self, block_hashes):  # type: ignore[no-untyped-def]
            raise KeyError("gone")

    top = CPUOffloadingManager(4, 2, cache_policy="lru")
    chain = TierChain([("cpu", top), ("disk", Refusing(4, 8, cache_policy="lru"))])
    _store(chain, _h(1, 2))
    _store(chain, _h(3))  # the top tier evicts 1 for it
    assert chain.lookup(_h(2, 3, 1)) == 3  # 2, 3 from the top, 1 from the bottom
    with pytest.raises(KeyError, match="gone"):
        chain.prepare_load(_h(2, 3, 1))
    out = top.prepare_store(_h(7, 8))  # 2 and 3 are not pinned: they can make room
    assert out is not None and sorted(out.block_hashes_evicted) == _h(2, 3)


def test_errors() -> None:
    with pytest.raises(ValueError, match="distinct"):
        TierChain([("a", CPUOffloadingManager(4, 2)), ("a", CPUOffloadingManager(4, 2))])
    chain = _chain()
    with pytest.raises(KeyError, match="no tier"):
        chain.prepare_load(_h(9))
    with pytest.raises(KeyError, match="no load in flight"):
        chain.complete_load(_h(9))
