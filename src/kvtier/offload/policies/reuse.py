"""`reuse`: recency plus capped reuse count, admission and weights chosen online.

Why: on real chat traces most stored blocks are never used again (76% on the
public Mooncake trace), so what matters most is which new blocks to let stay.
Each block is scored by the clock at its last use plus a bonus for its class
(`kvtier.offload.structures.scored_lists`): cold, first seen, seen twice, seen
more, or first seen in a request that extends a chain already known. No single set
of bonuses wins at every capacity and on every workload, so four settings (below)
run side by side on small shadow caches that see a 1/16 sample of the hashes (fed in batches of
up to BATCH requests, one call per shadow, while a batch stays under a sixteenth
of a shadow's capacity), and the cache follows whichever had the most decayed
hits lately: set dueling. The first setting is LRU with leaf-first eviction, and
another is followed only once it leads that one by LEAD hits, so when nothing
else clearly pays the policy is LRU.

A batch is not the requests one by one: a block stored and reused inside it is
no hit, and a block a setting would evict at once outlives the batch, which
flatters the settings that evict first-seen blocks at once. Batches short
against the shadow bound that error: at a quarter of its capacity, replays of
generated chats fell up to 1.3% below LRU; at a sixteenth, 0.3% at most.

Signals taken from the calls an engine already makes, no future knowledge:
- `touch(keys)` lists a request's blocks in order: its first two keys tell
  whether it extends a known chain, its last key is the request's last block;
- the last block of a request (partial in most traces, so rarely reused: under
  2% on the public trace) is stored COLD, evicted first, only while a small
  online predictor, fed with the sample, measures last blocks reused under a
  quarter as often as other first-seen blocks (on whole-block workloads they are
  reused as often, and stay);
- blocks are stored deepest first, and a request's hits are refreshed after its
  blocks come in, so within a class a parent always outlives its children.

Admission is ordering only: a block the policy does not want is stored in a
class evicted first (the manager owns slots; vLLM's `CachePolicy` cannot refuse
a block), so it takes a slot until the next eviction, and can still be hit then.
Inside vLLM (`kvtier.vllm`'s adapter) `touch` sees a request's missed keys and,
when it finishes, its reused ones, not its whole chain: the last-block signal
holds, the known-chain one mostly does not (first-seen blocks are then NEW).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence, Set
from itertools import compress, filterfalse, repeat
from operator import itemgetter

from kvtier.offload._fast import consume
from kvtier.offload.backend import BlockStatus
from kvtier.offload.policies.base import CachePolicy
from kvtier.offload.structures.scored_lists import COLD, NEW, NEW_IN_CHAIN, ScoredLists, Weights
from kvtier.types import BlockHash

# A bonus low enough to be evicted before anything that scored on recency.
DOOR = -1e6
# Bonuses in capacities (of blocks stored) for COLD, NEW, TWICE, MORE, NEW_IN_CHAIN.
SETTINGS: tuple[Weights, ...] = (
    (2 * DOOR, 0.0, 0.0, 0.0, 0.0),  # recency only: LRU, leaf first
    (2 * DOOR, 0.0, 0.5, 1.0, 0.0),  # recency plus capped frequency
    (2 * DOOR, -1.0, 0.0, 1.0, DOOR),  # first seen: a short stay; in a known chain: none
    (2 * DOOR, DOOR, 0.0, 1.0, 1.5 * DOOR),  # doorkeeper: blocks stay from their second sight
)
HISTORY = 6.0  # capacities of evicted hashes remembered (3 to 6: two generations)
SAMPLE_MASK = 15  # a hash is in the shadows' sample when its last byte & 15 == 0
_SAMPLED = frozenset(b for b in range(256) if not b & SAMPLE_MASK)  # last bytes
_LAST_BYTE = itemgetter(-1)
BATCH = 32  # requests whose samples the shadows take in one go, at most
BATCH_SHARE = 16  # ... and at most a 1/BATCH_SHARE of a shadow's capacity in keys
LEAD = 3.0  # decayed shadow hits a setting must lead the LRU setting by to be followed
DECAY = 0.999  # per request: the duel remembers about the last thousand requests
COLD_RATIO = 4.0  # last blocks go COLD when reused this many times less often
MIN_EVIDENCE = 32  # sampled last blocks seen before the predictor may say COLD


class _LastBlockReuse:
    """How often sampled first-seen blocks come back, for last blocks and the others.

    A block counts as reused if it is seen again before `horizon` newer blocks
    were first seen: the window a cache of this size could have kept it.
    """

    def __init__(self, horizon: int) -> None:
        self.horizon = max(1, horizon)
        # key -> 1 if it came as a request's last block, 0 if not, -1 once seen again
        self._first: OrderedDict[BlockHash, int] = OrderedDict()
        self.seen = [0, 0]  # [other, last]
        self.reused = [0, 0]
        self.is_cold = False  # what `_cold` said after the last `observe`

    def observe(self, sampled: list[BlockHash], last: BlockHash) -> None:
        first = self._first
        for key in sampled:
            tag = first.get(key)
            if tag is None:
                tag = int(key == last)
                first[key] = tag
                self.seen[tag] += 1
            elif tag >= 0:
                self.reused[tag] += 1
                first[key] = -1  # counted once
        while len(first) > self.horizon:
            first.popitem(last=False)
        self.is_cold = self._cold()

    def _cold(self) -> bool:
        """Whether last blocks are reused under 1/COLD_RATIO as often as the others."""
        if self.seen[1] < MIN_EVIDENCE:
            return False
        rate_last = (self.reused[1] + 1) / (self.seen[1] + 2)
        rate_other = (self.reused[0] + 1) / (self.seen[0] + 2)
        return rate_last * COLD_RATIO < rate_other


class ReuseCachePolicy(CachePolicy):
    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._main = ScoredLists(cache_capacity, SETTINGS[0], HISTORY)
        shadow_capacity = max(1, cache_capacity // (SAMPLE_MASK + 1))
        self._shadows = [ScoredLists(shadow_capacity, w, HISTORY) for w in SETTINGS]
        self._batch_keys = max(1, shadow_capacity // BATCH_SHARE)
        self._hits = [0.0] * len(SETTINGS)
        self.setting = 0  # index into SETTINGS, as chosen by the duel
        self._predictor = _LastBlockReuse(int(HISTORY * shadow_capacity))
        self._dummy = BlockStatus(-1)  # the shadows' blocks: ready, no slot
        self._dummy.ref_cnt = 0
        self._last: BlockHash | None = None  # the last touched request's last key
        self._first_seen = NEW  # NEW_IN_CHAIN if that request extends a known chain
        self._cold_last = False
        # sampled keys of the requests since the shadows last ran, and their classes
        self._queued: list[BlockHash] = []
        self._queued_classes: dict[BlockHash, int] = {}
        self._queued_requests = 0
        self._index = self._main.blocks
        self._pending_keys: list[BlockHash] = []  # inserted one by one, not yet ordered
        self._pending_blocks: list[BlockStatus] = []

    def __len__(self) -> int:
        return len(self._index)

    def stored_keys(self) -> list[BlockHash]:
        return list(self._index)

    def get(self, key: BlockHash) -> BlockStatus | None:
        return self._index.get(key)

    def get_iter(self, keys: Iterable[BlockHash]) -> Iterator[BlockStatus | None]:
        return map(self._index.get, keys)

    def get_many(self, keys: Sequence[BlockHash]) -> list[BlockStatus | None]:
        return list(map(self._index.get, keys))

    def absent(self, keys: Sequence[BlockHash]) -> list[BlockHash]:
        return list(filterfalse(self._index.__contains__, keys))

    def insert(self, key: BlockHash, block: BlockStatus) -> None:
        """Held until the next other call, then stored with the blocks inserted beside it:
        vLLM's manager inserts a store's blocks one by one, kvtier's all at once, and
        both must store them deepest first."""
        self._pending_keys.append(key)
        self._pending_blocks.append(block)
        self._index[key] = block

    def _flush(self) -> None:
        keys, blocks = self._pending_keys, self._pending_blocks
        self._pending_keys, self._pending_blocks = [], []
        self.insert_many(keys, blocks)

    def insert_many(self, keys: Sequence[BlockHash], blocks: Sequence[BlockStatus]) -> None:
        if self._pending_keys:
            self._flush()
        cold_last = self._cold_last and bool(keys) and keys[-1] == self._last
        self._main.insert(keys, blocks, self._first_seen, cold_last)

    def remove(self, key: BlockHash) -> None:
        if self._pending_keys:
            self._flush()
        self._main.remove(key)

    def touch(self, keys: Sequence[BlockHash]) -> None:
        if self._pending_keys:
            self._flush()
        if not keys:
            return
        main = self._main
        last = keys[-1]
        self._last = last
        in_chain = len(keys) > 1 and main.seen(keys[0]) and main.seen(keys[1])
        self._first_seen = NEW_IN_CHAIN if in_chain else NEW
        main.touch(keys)
        try:  # C-level: a byte per key, looked up in a set
            sampled = list(compress(keys, map(_SAMPLED.__contains__, map(_LAST_BYTE, keys))))
        except IndexError:  # an empty key
            sampled = [key for key in keys if key and key[-1] in _SAMPLED]
        if sampled:
            self._duel(sampled, last)

    def _duel(self, sampled: list[BlockHash], last: BlockHash) -> None:
        """Queue the sampled keys for the shadows; replay them once a batch is full."""
        self._predictor.observe(sampled, last)
        self._cold_last = self._predictor.is_cold
        self._queued += sampled
        classes = self._queued_classes
        consume(map(classes.setdefault, sampled, repeat(self._first_seen)))
        if self._cold_last and sampled[-1] == last:
            classes[last] = COLD
        self._queued_requests += 1
        if self._queued_requests >= BATCH or len(self._queued) >= self._batch_keys:
            self._replay_shadows()

    def _replay_shadows(self) -> None:
        """The queued requests as one, on every shadow (a call per shadow, not per request);
        then follow the shadow with the most hits lately."""
        queued, classes = self._queued, self._queued_classes
        hits = self._hits
        decay = DECAY**self._queued_requests
        for i, shadow in enumerate(self._shadows):
            hits[i] = hits[i] * decay + shadow.touch(queued)
            index = shadow.blocks
            absent = [key for key in classes if key not in index][-shadow.capacity :]
            if absent:
                shadow.evict(len(index) + len(absent) - shadow.capacity, frozenset())
                for c in (COLD, NEW, NEW_IN_CHAIN):
                    group = [key for key in absent if classes[key] == c]
                    if group:
                        shadow.insert(group, [self._dummy] * len(group), c, False)
        self._queued, self._queued_classes, self._queued_requests = [], {}, 0
        best = max(range(len(hits)), key=hits.__getitem__)
        if hits[best] < hits[0] + LEAD:  # the LRU setting is the default: others must lead
            best = 0
        if best != self.setting:
            self.setting = best
            self._main.set_weights(SETTINGS[best])

    def evict_split(
        self, n: int, protected: Set[BlockHash]
    ) -> tuple[list[BlockHash], list[BlockStatus]] | None:
        if self._pending_keys:
            self._flush()
        return self._main.evict(n, protected)

    def mark_evictable(self, keys: Sequence[BlockHash]) -> None:
        if self._pending_keys:
            self._flush()
        self._main.mark_evictable(keys)

    def keys(self) -> list[list[BlockHash]]:
        """Each class's keys, least recent first (COLD, NEW, TWICE, MORE, NEW_IN_CHAIN)."""
        if self._pending_keys:
            self._flush()
        return self._main.keys()
