"""The policy registry: names, errors listing the known names, outside policies."""

from __future__ import annotations

from collections.abc import Iterator, Set

import pytest

from kvtier.offload import CPUOffloadingManager, LRUCachePolicy, register_policy
from kvtier.offload.backend import BlockStatus
from kvtier.offload.policies import (
    ARCCachePolicy,
    available_policies,
    create_policy,
    get_policy_class,
    unregister_policy,
)
from kvtier.offload.policies.base import Victims
from kvtier.types import BlockHash, int_block_hash


class MRUPolicy(LRUCachePolicy):
    """A policy from outside the package: evicts the most recent blocks first."""

    def evict_split(
        self, n: int, protected: Set[BlockHash]
    ) -> tuple[list[BlockHash], list[BlockStatus]] | None:
        victims: Victims = []
        for key in reversed(self.keys()):
            block = self.get(key)
            evictable = block is not None and block.ref_cnt == 0 and key not in protected
            if evictable and len(victims) < n:
                victims.append((key, block))  # type: ignore[arg-type]
        if len(victims) < n:
            return None
        for key, _ in victims:
            self.remove(key)
        return [key for key, _ in victims], [block for _, block in victims]


@pytest.fixture
def mru() -> Iterator[None]:
    register_policy("mru", MRUPolicy)
    yield
    unregister_policy("mru")


def test_builtin_names() -> None:
    assert get_policy_class("lru") is LRUCachePolicy
    assert get_policy_class("arc") is ARCCachePolicy
    assert isinstance(create_policy("arc", 4), ARCCachePolicy)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown cache policy 'lfu'.*\['arc', 'lru', 'reuse'\]"):
        get_policy_class("lfu")
    with pytest.raises(ValueError, match="unknown cache policy"):
        CPUOffloadingManager(16, 4, "lfu")


def test_registered_policy_is_usable_by_name(mru: None) -> None:
    assert "mru" in available_policies()
    m = CPUOffloadingManager(16, 2, "mru")
    for i in range(3):
        out = m.prepare_store([int_block_hash(i)])
        assert out is not None
        m.complete_store(out.block_hashes_to_store)
    assert m.lookup([int_block_hash(0), int_block_hash(2)]) == 2  # 1 (most recent) went


def test_register_rejects_duplicates_and_non_policies(mru: None) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_policy("mru", MRUPolicy)
    with pytest.raises(ValueError, match="already registered"):
        register_policy("lru", MRUPolicy)  # type: ignore[type-abstract]
    with pytest.raises(TypeError, match="CachePolicy subclass"):
        register_policy("dict", dict)  # type: ignore[arg-type]


def test_load_by_module_path() -> None:
    assert get_policy_class("tests.offload.test_registry:MRUPolicy") is MRUPolicy
    with pytest.raises(ValueError, match="cannot import"):
        get_policy_class("no.such.module:Policy")
    with pytest.raises(ValueError, match="does not name a CachePolicy"):
        get_policy_class("tests.offload.test_registry:h")


def h() -> None:
    """Not a policy."""
