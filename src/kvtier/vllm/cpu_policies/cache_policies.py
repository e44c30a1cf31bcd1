"""kvtier's cache policies as eviction policies of vLLM's own CPU offloading tier.

vLLM's `CPUOffloadingManager` loads an out-of-tree policy with two config keys,
`"eviction_policy": NAME, "cache_policy_module_path": "kvtier.vllm"`, as
`getattr(kvtier.vllm, NAME)`. Every policy in kvtier's registry is offered under
the name `"kvtier_" + its registry name` (`kvtier_lru`, `kvtier_arc`, and each
policy added to the registry later, with no code here): the classes are made on
first use from the registry, so this module never lists policies by hand.

The adapter keeps vLLM's manager in charge of slots, reference counts and events
and hands the ordering to kvtier's policy, call for call. The decisions are then
those of kvtier's own `CPUOffloadingManager` with the same policy, where vLLM's
request-scoped hooks map to kvtier's `touch`:

- `touch(keys)` and `on_store_miss(keys)` (vLLM's default: a touch of the missed
  keys, which lets ARC learn from its ghost lists before the insert) are touches;
- `on_request_finished` touches the keys the request *reused* (loaded, or found
  ready when it offered them), head to tail, so the prefix's head ends most
  recent. Keys the request only inserted are not touched: a store is not a second
  use (kvtier's ARC would otherwise promote every new block to T2).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, cast

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from kvtier.offload.backend import BlockStatus
from kvtier.offload.policies import CachePolicy as KvtierPolicy
from kvtier.offload.policies import available_policies, get_policy_class
from kvtier.types import BlockHash

PREFIX = "kvtier_"

Victims = list[tuple[OffloadKey, ChunkStatus]]


class KvtierCachePolicy(CachePolicy):
    """A vLLM `CachePolicy` over one kvtier policy; subclasses name it in `kvtier_policy`.

    vLLM's `ChunkStatus` objects are stored in kvtier's policy as they are: kvtier's
    policies read only `ref_cnt` from a stored block, which both classes have.
    """

    kvtier_policy: ClassVar[str]

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.policy: KvtierPolicy = get_policy_class(self.kvtier_policy)(cache_capacity)
        self._inserting: tuple[list[BlockHash], list[BlockStatus]] = ([], [])

    def _flushed(self) -> KvtierPolicy:
        """kvtier's policy, once the blocks vLLM inserted one by one reached it.

        vLLM inserts a store's blocks in one loop of `insert` calls; kvtier's manager
        hands them over in one `insert_many`, which a policy may treat as one request's
        blocks (`reuse` does). So inserts wait here until the next call of any kind.
        """
        keys, blocks = self._inserting
        if keys:
            self._inserting = ([], [])
            self.policy.insert_many(keys, blocks)
        return self.policy

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        if self._inserting[0]:
            self._flushed()
        return cast(ChunkStatus | None, self.policy.get(BlockHash(key)))

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self._inserting[0].append(BlockHash(key))
        self._inserting[1].append(cast(BlockStatus, chunk))

    def remove(self, key: OffloadKey) -> None:
        self._flushed().remove(BlockHash(key))

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._flushed().touch(cast(list[BlockHash], list(keys)))

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        if not reused_keys:
            return
        ordered = order_request_keys(key_groups, req_context)
        self._flushed().touch(cast(list[BlockHash], [k for k in ordered if k in reused_keys]))

    def evict(self, n: int, protected: set[OffloadKey]) -> Victims | None:
        victims = self._flushed().evict(n, cast(set[BlockHash], protected))
        return cast(Victims | None, victims)

    def clear(self) -> None:
        self._inserting = ([], [])
        self.policy = get_policy_class(self.kvtier_policy)(self.cache_capacity)

    def mark_evictable(self, key: OffloadKey) -> None:
        self._flushed().mark_evictable((BlockHash(key),))

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._flushed()


_classes: dict[str, type[KvtierCachePolicy]] = {}


def policy_names() -> list[str]:
    """Every name vLLM can load from `kvtier.vllm` as an eviction policy."""
    return [PREFIX + name for name in available_policies()]


def policy_class(name: str) -> type[KvtierCachePolicy]:
    """The vLLM policy class for `kvtier_<registry name>` (the same class on every call)."""
    cls = _classes.get(name)
    if cls is not None:
        return cls
    policy = name[len(PREFIX) :] if name.startswith(PREFIX) else None
    if policy is None or policy not in available_policies():
        raise AttributeError(
            f"kvtier has no cache policy {name!r} for vLLM; available: {policy_names()}"
        )
    get_policy_class(policy)  # a registered policy that fails to import fails here
    cls = type(
        name,
        (KvtierCachePolicy,),
        {
            "kvtier_policy": policy,
            "__module__": "kvtier.vllm",
            "__doc__": f"kvtier's {policy!r} cache policy for vLLM's CPU offloading tier.",
        },
    )
    _classes[name] = cls
    return cls


def __getattr__(name: str) -> Any:
    if name.startswith(PREFIX):
        return policy_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
