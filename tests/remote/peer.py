"""A second engine in its own OS process: `python -m tests.remote.peer store|lookup URL N`.

`store` writes blocks 0..N-1 with payloads derived from their ids; `lookup`
prints how many leading blocks it finds and whether every one loads back
byte-identical. The two-process test runs one of each.
"""

from __future__ import annotations

import json
import sys

from kvtier.remote.tier import RemoteTier
from kvtier.types import int_block_hash

FP = "model=tiny|dtype=fp16|block=16|format=1"


def payload(i: int) -> bytes:
    return i.to_bytes(4, "big") * 1024


def main(argv: list[str]) -> int:
    command, url, count = argv[0], argv[1], int(argv[2])
    hashes = [int_block_hash(i) for i in range(count)]
    with RemoteTier.from_url(url, FP, block_size=16) as tier:
        if command == "store":
            ok = tier.store.store(hashes, [payload(i) for i in range(count)])
            print(json.dumps({"stored": ok}))
            return 0
        hits = tier.manager().lookup(hashes) or 0
        loaded = tier.store.load(hashes[:hits])
        intact = all(v is not None and v == payload(i) for i, v in enumerate(loaded))
        print(json.dumps({"hits": hits, "intact": intact, "loaded": tier.stats.loaded_blocks}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
