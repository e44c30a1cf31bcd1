"""C-level loop helpers for the hot paths.

`map`/`filter` over bound methods of built-in types (a dict's `get`, a set's
`__contains__`) run the per-block loop inside the interpreter's C code instead of
bytecode, two to four times cheaper per block than the equivalent `for` loop, and
the offload managers loop over ~24 blocks per call. Not so with `attrgetter`: it
looks the attribute up generically, and costs more per object than a loop's own
attribute access (specialised by the interpreter for `__slots__`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Set
from itertools import islice, repeat
from operator import attrgetter, itemgetter
from typing import Any, Protocol, TypeVar

K = TypeVar("K")
V = TypeVar("V")

# drain an iterator at C speed, keeping nothing (a bound method: no Python frame)
consume: Callable[[Iterable[Any]], None] = deque[Any](maxlen=0).extend

first = itemgetter(0)
second = itemgetter(1)
ref_cnt = attrgetter("ref_cnt")
block_id = attrgetter("block_id")


class Counted(Protocol):
    ref_cnt: int


C = TypeVar("C", bound=Counted)


def pop_head(order: OrderedDict[K, C], n: int, protected: Set[K]) -> tuple[list[K], list[C]] | None:
    """Pop the n least recent entries if none is protected or has a non-zero `ref_cnt`.

    One `pop` per entry (a lookup and an unlink) instead of a read then a delete;
    in the rare case that an entry may not go, they are put back in place (None).
    """
    if len(order) < n:
        return None
    keys = list(islice(order, n))  # walks the links: no lookups, no pairs
    values = list(map(order.pop, keys))
    if protected.isdisjoint(keys):
        for value in values:  # (a loop: `map` of an attrgetter costs more per entry)
            if value.ref_cnt:
                break
        else:
            return keys, values
    push_head(order, keys, values)
    return None


def push_head(order: OrderedDict[K, V], keys: list[K], values: list[V]) -> None:
    """Undo `pop_head`: put the entries back at the least recent end, in order."""
    order.update(zip(keys, values, strict=True))  # to the most recent end, then to the front
    consume(map(order.move_to_end, reversed(keys), repeat(False)))
