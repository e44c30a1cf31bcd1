"""C-level loop helpers for the hot paths.

`map`/`filter` over bound methods run the per-block loop inside the interpreter's
C code instead of bytecode, two to four times cheaper per block than the
equivalent `for` loop, and the offload managers loop over ~24 blocks per call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from operator import attrgetter, itemgetter
from typing import Any

# drain an iterator at C speed, keeping nothing (a bound method: no Python frame)
consume: Callable[[Iterable[Any]], None] = deque[Any](maxlen=0).extend

first = itemgetter(0)
second = itemgetter(1)
ref_cnt = attrgetter("ref_cnt")
block_id = attrgetter("block_id")
