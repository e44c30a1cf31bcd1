"""The shared stateful test suite for offloading managers.

`offloading_manager_machine(factory, capacity=...)` builds a hypothesis
`RuleBasedStateMachine` that drives a fresh manager with random interleavings of
all seven calls (lookup, prepare_load, touch, complete_load, prepare_store,
complete_store, take_events) and caller mistakes, and checks it against a model
built only from the manager's own answers:

- a block returned in `block_hashes_to_store` is present (in flight) until a failed
  `complete_store` or until it appears in `block_hashes_evicted`; a successful
  `complete_store` makes it ready, and `lookup` must then count it (a stored block
  is loadable until evicted) and `prepare_load` must accept it;
- no pinned (loading) or in-flight block, and no hash of the current call, is ever
  evicted; `block_hashes_to_store` is exactly the absent input hashes, in order;
- never more than `capacity` blocks present; slot ids (specs with `block_ids`)
  are distinct among present blocks, in [0, capacity), and a load names the slot
  the store got;
- replaying the events from empty gives exactly the set of ready blocks;
- ghost lists (if `ghost_sizes` is given) never exceed `capacity`;
- rejected calls (loading an absent or in-flight block, completing a load that was
  not started, a key that is not bytes) raise KeyError/ValueError and change nothing;
- repeated hashes in one call are accepted: `prepare_store` and `complete_store`
  take each hash once (a second slot, a second free or a second store event would
  be a bug), `prepare_load` pins once per listing (its spec names the slot per
  listing) and `complete_load` releases once per listing.

Using it for a new manager (e.g. a disk tier), in a test module::

    from hypothesis import settings
    from tests.offload.suite import offloading_manager_machine

    DiskMachine = offloading_manager_machine(
        lambda: MyManager(..., num_blocks=4, enable_events=True), capacity=4
    )
    TestDisk = DiskMachine.TestCase
    TestDisk.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)

The factory must return a manager with events enabled and room for `capacity`
blocks. Options relax checks a manager legitimately does differently:
`exact_lookup=False` (lookup may answer None or count blocks the model does not
know), `exact_evictions=False` (evicts other than exactly the shortfall),
`strict_errors=False` (skips the caller-mistake rules), `check_slots=False`.
`check_ref_counts=True` (for managers with `get_block(hash) -> BlockStatus`)
checks after every step that each block's reference count is exactly the model's
(-1 in flight, else the number of loads in flight), which also proves a rejected
call left no pin behind. `exact_rejections=True` additionally asserts a None
from prepare_store means fewer evictable blocks than needed (true for LRU, not
for ARC). `reference`, a second factory, mirrors every call to another manager
and requires identical answers (a differential test); being vLLM's behaviour, the
reference gets `prepare_store`'s hashes de-duplicated (vLLM would give a repeat a
second slot, which kvtier deliberately does not).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.offload.abstract import OffloadingManager, PrepareStoreOutput
from kvtier.types import BlockHash, int_block_hash

READY, IN_FLIGHT = "ready", "in flight"
BAD_KEYS = ("abc", 7, None, 1.5, ["a"])
CALLS_TAKING_KEYS = ("prepare_store", "complete_store", "prepare_load", "complete_load", "touch")


def _slot_ids(spec: Any) -> list[int] | None:
    ids = getattr(spec, "block_ids", None)
    return None if ids is None else [int(i) for i in ids]


def _normal(name: str, value: Any) -> Any:
    """An answer in a comparable form (specs by slot ids, outputs as tuples)."""
    if isinstance(value, PrepareStoreOutput):
        return (
            list(value.block_hashes_to_store),
            _slot_ids(value.store_spec),
            list(value.block_hashes_evicted),
        )
    if name == "prepare_load":
        return _slot_ids(value)
    return value


def offloading_manager_machine(
    factory: Callable[[], OffloadingManager],
    *,
    capacity: int,
    num_hashes: int | None = None,
    ghost_sizes: Callable[[OffloadingManager], Sequence[int]] | None = None,
    exact_lookup: bool = True,
    exact_evictions: bool = True,
    exact_rejections: bool = False,
    strict_errors: bool = True,
    check_slots: bool = True,
    check_ref_counts: bool = False,
    reference: Callable[[], Any] | None = None,
) -> type[RuleBasedStateMachine]:
    """A state machine class for `factory`'s manager; see the module docstring."""
    universe = num_hashes if num_hashes is not None else 3 * capacity + 2
    hash_lists = st.lists(st.integers(0, universe - 1), unique=True, max_size=6).map(
        lambda ids: [int_block_hash(i) for i in ids]
    )
    # the same lists with up to three hashes listed again, anywhere
    repeating_lists = hash_lists.flatmap(_with_repeats)

    class OffloadingManagerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.manager = factory()
            self.ref = reference() if reference is not None else None
            self.state: dict[BlockHash, str] = {}
            self.pins: Counter[BlockHash] = Counter()
            self.slots: dict[BlockHash, int] = {}
            self.replayed: set[BlockHash] = set()

        # --- helpers ---------------------------------------------------

        def call(self, name: str, *args: Any) -> Any:
            answer = getattr(self.manager, name)(*args)
            if self.ref is not None:
                ref_args = args
                if name == "prepare_store":
                    ref_args = (list(dict.fromkeys(args[0])),)
                ref_answer = getattr(self.ref, name)(*ref_args)
                assert _normal(name, answer) == _normal(name, ref_answer), (name, args)
            return answer

        def ready(self) -> list[BlockHash]:
            return sorted(h for h, s in self.state.items() if s == READY)

        def in_flight(self) -> list[BlockHash]:
            return sorted(h for h, s in self.state.items() if s == IN_FLIGHT)

        def leading_ready(self, hashes: list[BlockHash]) -> int:
            n = 0
            for h in hashes:
                if self.state.get(h) != READY:
                    break
                n += 1
            return n

        def expect_rejected(self, name: str, *args: Any) -> None:
            try:
                getattr(self.manager, name)(*args)
            except (KeyError, ValueError):
                return
            raise AssertionError(f"{name}{args} should have been rejected")

        # --- the seven calls -------------------------------------------

        @rule(hashes=repeating_lists)
        def lookup(self, hashes: list[BlockHash]) -> None:
            hits = self.call("lookup", hashes)
            if exact_lookup:
                assert hits == self.leading_ready(hashes), (hits, hashes, self.state)
            else:
                assert hits is None or 0 <= hits <= len(hashes)

        @precondition(lambda self: any(s == READY for s in self.state.values()))
        @rule(data=st.data())
        def prepare_load(self, data: st.DataObject) -> None:
            ready = self.ready()
            load = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=4))
            spec = self.call("prepare_load", load)
            self.pins.update(load)
            ids = _slot_ids(spec)
            if check_slots and ids is not None:
                assert ids == [self.slots[h] for h in load]

        @precondition(lambda self: bool(+self.pins))
        @rule(data=st.data())
        def complete_load(self, data: st.DataObject) -> None:
            # each pin at most once: a hash pinned twice may be listed twice
            pool = sorted(self.pins.elements())
            picks = st.lists(st.integers(0, len(pool) - 1), unique=True, min_size=1, max_size=4)
            done = [pool[i] for i in data.draw(picks)]
            self.call("complete_load", done)
            self.pins.subtract(done)

        @rule(hashes=repeating_lists)
        def touch(self, hashes: list[BlockHash]) -> None:
            self.call("touch", hashes)

        @rule(hashes=repeating_lists)
        def prepare_store(self, hashes: list[BlockHash]) -> None:
            absent = [h for h in dict.fromkeys(hashes) if h not in self.state]
            need = len(absent) - (capacity - len(self.state))
            out = self.call("prepare_store", hashes)
            if out is None:
                self.check_rejection(hashes, need)
                return
            assert list(out.block_hashes_to_store) == absent
            evicted = list(out.block_hashes_evicted)
            self.check_evicted(hashes, evicted, need)
            for h in evicted:
                del self.state[h]
                self.slots.pop(h, None)
            self.record_slots(absent, _slot_ids(out.store_spec))
            for h in absent:
                self.state[h] = IN_FLIGHT

        def check_rejection(self, hashes: list[BlockHash], need: int) -> None:
            assert need > 0, "a store that fits without evicting must not be rejected"
            if exact_rejections:
                evictable = [h for h in self.ready() if not self.pins[h] and h not in hashes]
                assert len(evictable) < need, (evictable, need)

        def check_evicted(
            self, hashes: list[BlockHash], evicted: list[BlockHash], need: int
        ) -> None:
            assert len(set(evicted)) == len(evicted)
            for h in evicted:
                assert self.state.get(h) == READY, f"evicted {h!r} in state {self.state.get(h)}"
                assert not self.pins[h], f"evicted pinned block {h!r}"
                assert h not in hashes, f"evicted {h!r}, a hash of the same call"
            if exact_evictions:
                assert len(evicted) == max(need, 0)

        def record_slots(self, stored: list[BlockHash], ids: list[int] | None) -> None:
            if not check_slots or ids is None:
                return
            assert len(ids) == len(stored)
            taken = set(self.slots.values())
            for h, slot in zip(stored, ids, strict=True):
                assert 0 <= slot < capacity and slot not in taken, (slot, taken)
                taken.add(slot)
                self.slots[h] = slot

        @precondition(lambda self: any(s == IN_FLIGHT for s in self.state.values()))
        @rule(data=st.data(), success=st.booleans(), extra=hash_lists)
        def complete_store(
            self, data: st.DataObject, success: bool, extra: list[BlockHash]
        ) -> None:
            flight = self.in_flight()
            done = data.draw(st.lists(st.sampled_from(flight), unique=True, min_size=1))
            done += [h for h in extra if h not in done]  # absent or ready: ignored
            done += data.draw(st.lists(st.sampled_from(done), max_size=3))  # settled once
            self.call("complete_store", done, success)
            for h in dict.fromkeys(done):
                if self.state.get(h) == IN_FLIGHT:
                    if success:
                        self.state[h] = READY
                    else:
                        del self.state[h]
                        self.slots.pop(h, None)

        @rule()
        def take_events(self) -> None:
            for event in self.call_events():
                if event.removed:
                    self.replayed.difference_update(event.block_hashes)
                else:
                    self.replayed.update(event.block_hashes)
            assert self.replayed == set(self.ready())

        def call_events(self) -> list[Any]:
            events = list(self.manager.take_events())
            if self.ref is not None:
                ref_events = list(self.ref.take_events())
                assert [vars(e) for e in events] == [vars(e) for e in ref_events]
            return events

        # --- caller mistakes -------------------------------------------

        @precondition(lambda self: strict_errors)
        @rule(hashes=hash_lists, bad=st.integers(0, universe - 1))
        def load_missing(self, hashes: list[BlockHash], bad: int) -> None:
            load = [h for h in hashes if self.state.get(h) == READY]
            bad_hash = int_block_hash(bad)
            if self.state.get(bad_hash) == READY:
                return
            self.expect_rejected("prepare_load", [*load, bad_hash])

        @precondition(lambda self: strict_errors and bool(self.ready()))
        @rule(data=st.data())
        def complete_unpinned_load(self, data: st.DataObject) -> None:
            unpinned = [h for h in self.ready() if not self.pins[h]]
            if unpinned:
                self.expect_rejected(
                    "complete_load", [*sorted(+self.pins), data.draw(st.sampled_from(unpinned))]
                )

        @precondition(lambda self: strict_errors)
        @rule(
            hashes=hash_lists,
            name=st.sampled_from(CALLS_TAKING_KEYS),
            bad=st.sampled_from(BAD_KEYS),
            at=st.integers(0, 6),
        )
        def bad_key(self, hashes: list[BlockHash], name: str, bad: Any, at: int) -> None:
            # otherwise valid calls, so that the key alone is what gets them refused
            if name == "prepare_load":
                hashes = [h for h in hashes if self.state.get(h) == READY]
            elif name == "complete_load":
                hashes = sorted(+self.pins)
            self.expect_rejected(name, [*hashes[:at], bad, *hashes[at:]])

        # --- invariants ------------------------------------------------

        @invariant()
        def within_capacity(self) -> None:
            assert len(self.state) <= capacity
            length = getattr(self.manager, "__len__", None)
            if length is not None:
                assert length() == len(self.state)

        @invariant()
        def ref_counts_match(self) -> None:
            if not check_ref_counts:
                return
            for h, state in self.state.items():
                block = self.manager.get_block(h)  # type: ignore[attr-defined]
                expected = -1 if state == IN_FLIGHT else self.pins[h]
                assert block is not None and block.ref_cnt == expected, (h, block, expected)

        @invariant()
        def ghosts_bounded(self) -> None:
            if ghost_sizes is not None:
                assert all(size <= capacity for size in ghost_sizes(self.manager))

    return OffloadingManagerMachine


def _with_repeats(hashes: list[BlockHash]) -> st.SearchStrategy[list[BlockHash]]:
    if not hashes:
        return st.just(hashes)
    extra = st.lists(st.sampled_from(hashes), max_size=3)
    return extra.flatmap(lambda more: st.permutations([*hashes, *more]))
