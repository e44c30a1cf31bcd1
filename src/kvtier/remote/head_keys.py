"""Blocks kept by KV head group in the shared tier, so engines of any parallel layout share them.

A tensor-parallel worker holds only its own KV heads of every block. Kept under a key
named by the worker's rank, a block could be read back only by an engine cut the same
way. So the key names what the bytes are instead: the layout every engine of the model
shares (model, dtype, block size, KV-cache groups, KV heads, page order) and the run
of heads the value holds (`HeadGroup`). Each worker writes its heads of a block as one
value (`head_codec`: a header with every head's own checksum, then the heads), so an
engine reading its own layout's blocks makes one GET per block and worker, as one value
per block did, with keys and headers of the same size (48 bytes of header for a value
of one head, 8 more for each further head).

An engine of another layout reads the heads it needs from the groups that hold them:
one pipelined round trip per grouping reads each group's header and its heads' byte
range (GETRANGE; one GETRANGE where the range follows the header), verified head by head.
A lookup walks the engine's own grouping first (one round trip, as before: the prefix
script over the same number of keys); where it stops, one round trip asks which
grouping holds that block whole (for a question of one block, as vLLM asks, that is its
answer), and the walk goes on in that grouping. Writers name their grouping in a set
(`GROUPINGS_KEY`, refreshed every REGISTER_EVERY_S while they store) that the walk reads
in its own round trip: where no other grouping was ever written, a walk that stops is
final, and a cold prompt costs one round trip (a second one, which asked every grouping
whether it held the block, doubled every slow Redis lookup: 0.4 s through a link adding
0.2 s); where one was, it costs a second (short) round trip, and a block of another
layout one more at most. The scheduler's store
remembers where its lookups found blocks of another layout (`holders_of`) and the load
spec carries it to the workers, which read there first: a block of another layout costs
its worker one round trip, as a GET of its own does, not a GET that misses and then the
ranges (README, `bench_vllm --shapes cross`: a two-worker engine's cross-layout hits
went from 1.82x a same-layout hit's TTFT to 1.01x and 0.74x in two runs).

A block is in the tier only when every head is: a lookup counts a block only where
every group of one grouping is there, and a worker's load fails where any of its heads
is missing or corrupt, so the engine recomputes the block on all its workers (a corrupt
value is deleted, and later lookups stop before it).

Models where several workers hold the same bytes (fewer KV heads than workers, or an
MLA latent every worker keeps whole) store them once: `head_shard.HeadShard.writes` is true on one
of the workers holding a head (the first), and all of them read it.

A head's bytes are every layer's of that head in the engine's own page order
(`head_shard.HeadShard` says nothing about it): the fingerprint that namespaces the keys names
that order, so only engines that cut their pages the same way share.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from functools import partial

from redis.exceptions import RedisError

from kvtier.remote.head_codec import GroupCodec, HeadGroup, group_sizes, grouping, header_size
from kvtier.remote.redis_store import _REFUSED, Payload, RedisBlockStore
from kvtier.remote.remote_config import RemoteConfig
from kvtier.validate import positive_int

# the set naming every grouping (heads a value) writers of this model's layout used,
# under the store's key base; refreshed by each writer at most this often
GROUPINGS_KEY = b"groupings"
REGISTER_EVERY_S = 10.0
MAX_HEADS = 1 << 16  # a value's head count is two bytes of its header
MAX_HOLDERS = 1 << 16  # blocks whose grouping a lookup remembers for the loads
_PREFIX_BYTES = 32  # what a lookup compares (`head_codec`)

log = logging.getLogger(__name__)


class HeadKeyedStore(RedisBlockStore):
    """A `RedisBlockStore` whose blocks are kept by head group (see the module docstring).

    Lookups, `store` and `load` speak of whole blocks as the base class does (so the
    remote tier's manager and its asynchronous lookups use it unchanged), in this
    engine's grouping (`group_heads` heads a value); a worker moves its own heads with
    `store_group` / `load_group`. The store's counters (`stats`) count values, the unit
    Redis holds."""

    heads: int = 1
    group_heads: int = 1
    sizes: list[int]  # heads a value, of every grouping: this engine's first
    _fingerprint: str | bytes
    _groups: dict[HeadGroup, tuple[RedisBlockStore, GroupCodec]]
    # blocks recent lookups found whole in another grouping: heads a value (`holders_of`)
    _holders: OrderedDict[bytes, int]
    _holders_lock: threading.Lock
    _registered: dict[int, float]  # groupings this store named in GROUPINGS_KEY, and when

    @classmethod
    def connect_heads(
        cls,
        config: RemoteConfig,
        fingerprint: str | bytes,
        heads: int,
        group_heads: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> HeadKeyedStore:
        """`RedisBlockStore.connect`, for blocks of `heads` KV heads that this engine's
        workers write `group_heads` at a time (default all: one worker)."""
        positive_int("KV heads", heads)
        group_heads = heads if group_heads is None else group_heads
        positive_int("KV heads a value", group_heads)
        if heads > MAX_HEADS or heads % group_heads:
            raise ValueError(
                f"{heads} KV heads do not cut into values of {group_heads} heads "
                f"(at most {MAX_HEADS} heads)"
            )
        store = cls.connect(config, fingerprint, clock)
        store.heads, store.group_heads = heads, group_heads
        store._fingerprint = fingerprint
        store._groups = {}
        store.sizes = group_sizes(heads, group_heads)
        store._holders, store._holders_lock = OrderedDict(), threading.Lock()
        store._registered = {}
        return store

    def group_store(self, group: HeadGroup) -> RedisBlockStore:
        """The values of `group` (their own keys and envelope) over this store's connection."""
        return self._group(group)[0]

    def _group(self, group: HeadGroup) -> tuple[RedisBlockStore, GroupCodec]:
        made = self._groups.get(group)
        if made is None:
            if group.end > self.heads:
                raise ValueError(f"heads {group.heads} are not among the model's {self.heads}")
            codec = GroupCodec.for_group(self._fingerprint, group)
            made = self._groups[group] = (self.sibling(codec), codec)
        return made

    def group_key(self, block_hash: bytes, group: HeadGroup, salt: str | None = None) -> bytes:
        return self.group_store(group).key(block_hash, salt)

    # -- lookups -------------------------------------------------------------------------

    def try_count_prefix(
        self, block_hashes: Sequence[bytes], salt: str | None = None, fetch: int = 0
    ) -> int | None:
        found = self.try_count_prefixes([block_hashes], salt, fetch)
        return None if found is None else found[0]

    def try_count_prefixes(
        self, questions: Sequence[Sequence[bytes]], salt: str | None = None, fetch: int = 0
    ) -> list[int] | None:
        call = partial(self._count_prefixes, questions, salt, fetch)
        found: list[int] | None = self._guarded("lookup", call, None)
        hits = 0 if found is None else sum(found)
        self._counters.add(lookups=len(questions), lookup_hit_blocks=hits)
        return found

    def _count_prefixes(
        self, questions: Sequence[Sequence[bytes]], salt: str | None, fetch: int = 0
    ) -> list[int]:
        """Walk this engine's grouping; where a walk stops, find which grouping holds that
        block whole (that read is its lookup: a question of one block, as vLLM's are, is
        answered there) and walk on in it from the next block (see the module docstring).
        The blocks found in another grouping are remembered for the loads (`holders_of`).
        `fetch`: the first that many blocks of the own walk are read whole where a load
        here would read them as they are (one value a block, `prefetch`)."""
        found, written = self._walk_own([(q, 0) for q in questions], salt, fetch)
        if self._holders:  # found in this engine's grouping now: read there
            self._forget_holders([h for q, n in zip(questions, found, strict=True) for h in q[:n]])
        pending = [i for i, q in enumerate(questions) if found[i] < len(q)]
        if written is not None and not written & set(self.sizes) - {self.group_heads}:
            return found  # no other grouping was ever written: where the walk stops, none
        while pending:
            holders = self._whole_at([questions[i][found[i]] for i in pending], salt)
            walked = []
            for size in self.sizes:
                ids = [i for i, held in zip(pending, holders, strict=True) if held == size]
                starts = {i: found[i] for i in ids}
                for i in ids:
                    found[i] += 1  # whole in `size`: its headers were just read
                ids = [i for i in ids if found[i] < len(questions[i])]
                if ids:
                    steps = self._walk(size, [(questions[i], found[i]) for i in ids], salt)
                    for i, step in zip(ids, steps, strict=True):
                        found[i] += step
                        if found[i] < len(questions[i]):
                            walked.append(i)
                held = [h for i, start in starts.items() for h in questions[i][start : found[i]]]
                self._remember_holders(held, size)
            pending = walked
        return found

    def _walk(
        self, size: int, starts: list[tuple[Sequence[bytes], int]], salt: str | None
    ) -> list[int]:
        """For each (question, start): how many blocks from `start` on have every group of
        `size` heads there, in one round trip."""
        return self._walk_and(size, starts, salt, False)[0]

    def _walk_own(
        self, starts: list[tuple[Sequence[bytes], int]], salt: str | None, fetch: int = 0
    ) -> tuple[list[int], set[int] | None]:
        """`_walk` in this engine's grouping, and the groupings ever written (None: not
        known), read in the same round trip where another grouping is possible."""
        return self._walk_and(self.group_heads, starts, salt, len(self.sizes) > 1, fetch)

    def _walk_and(
        self,
        size: int,
        starts: list[tuple[Sequence[bytes], int]],
        salt: str | None,
        groupings: bool,
        fetch: int = 0,
    ) -> tuple[list[int], set[int] | None]:
        groups = [self.group_store(g) for g in grouping(self.heads, size)]
        keys, expected = [], []
        for question, start in starts:
            hashes = question[start:]
            per_group = [g._keys(hashes, salt) for g in groups]
            keys.append([k for block in zip(*per_group, strict=True) for k in block])
            expected.append([g.codec.expected_prefix(h) for h in hashes for g in groups])
        members_of = self._base + GROUPINGS_KEY if groupings else None
        # every group's values of the first `fetch` blocks, where each group's worker
        # takes them (a worker loads its own heads' values)
        served = all(g._fetchable(fetch) for g in groups)
        fetch = fetch * len(groups) if served else 0
        answers, members = self._walk_prefixes_and(keys, expected, members_of, fetch)
        for (question, start), (items, stopper) in zip(starts, answers, strict=True):
            if stopper:  # present but refused: say why
                block, group = divmod(items, len(groups))
                self._count_refused(groups[group].codec, question[start + block], stopper)
        written = None
        if members is not None:
            written = {int(m) for m in members if m.isdigit()}
        return [items // len(groups) for items, _ in answers], written

    def prefetched_count(self, block_hashes: Sequence[bytes], salt: str | None = None) -> int:
        """How many of the blocks a lookup read whole in every group of this engine's
        grouping (each worker's values)."""
        groups = grouping(self.heads, self.group_heads)
        return min(self.group_store(g).prefetched_count(block_hashes, salt) for g in groups)

    def _register(self, heads: int) -> None:
        """Name the grouping of `heads` heads a value in GROUPINGS_KEY (at most once every
        REGISTER_EVERY_S, before the values: a reader that sees a value sees its grouping,
        and a set lost to eviction or a restart comes back with the next stores). A
        failure is left for the next store to mend: the values are what matter."""
        now = time.monotonic()
        last = self._registered.get(heads)
        if last is not None and now - last < REGISTER_EVERY_S:
            return
        try:
            self.client.sadd(self._base + GROUPINGS_KEY, str(heads))
        except (RedisError, OSError) as exc:
            log.debug("remote tier: naming grouping %d failed: %s", heads, exc)
            return
        self._registered[heads] = now

    def _whole_at(self, block_hashes: list[bytes], salt: str | None) -> list[int | None]:
        """For each block, the first grouping (in `sizes` order) whose every group is
        there, or None: one round trip of header reads."""
        self.lookup_round_trips += 1
        pipe = self.client.pipeline(transaction=False)
        asked = []
        for block_hash in block_hashes:
            for size in self.sizes:
                for group in grouping(self.heads, size):
                    store = self.group_store(group)
                    pipe.getrange(store._keys((block_hash,), salt)[0], 0, _PREFIX_BYTES - 1)
                    asked.append(store.codec.expected_prefix(block_hash))
        replies = iter(zip(asked, pipe.execute(raise_on_error=False), strict=True))
        holders: list[int | None] = []
        for _ in block_hashes:
            holder = None
            for size in self.sizes:
                answers = [next(replies) for _ in range(self.heads // size)]
                if holder is None and all(want == got for want, got in answers):
                    holder = size
            holders.append(holder)
        return holders

    def holders_of(self, block_hashes: Sequence[bytes]) -> list[int] | None:
        """For each block, the heads a value of the grouping a recent lookup found it
        whole in, where that is not this engine's (0: this engine's, or not known); None
        when no block has one. A load told this reads there first (`load_group`), instead
        of a GET of its own values that misses; a stale answer costs that GET after all."""
        with self._holders_lock:
            held = [self._holders.get(h, 0) for h in block_hashes]
        return held if any(held) else None

    def _remember_holders(self, block_hashes: Sequence[bytes], size: int) -> None:
        if size == self.group_heads:
            self._forget_holders(block_hashes)
            return
        with self._holders_lock:
            for block_hash in block_hashes:
                self._holders[block_hash] = size
                self._holders.move_to_end(block_hash)
            while len(self._holders) > MAX_HOLDERS:
                self._holders.popitem(last=False)

    def _forget_holders(self, block_hashes: Sequence[bytes]) -> None:
        if self._holders:
            with self._holders_lock:
                for block_hash in block_hashes:
                    self._holders.pop(block_hash, None)

    # -- whole blocks, in this engine's grouping -----------------------------------------

    def store(
        self,
        block_hashes: Sequence[bytes],
        payloads: Sequence[Payload],
        salt: str | None = None,
    ) -> bool:
        """Whole blocks, each cut into this engine's groups (a round trip per group)."""
        if len(block_hashes) != len(payloads):
            raise ValueError(f"{len(block_hashes)} hashes but {len(payloads)} payloads")
        groups = grouping(self.heads, self.group_heads)
        parts = split_heads(payloads, len(groups))
        return all(
            self.store_group(block_hashes, group, parts[i :: len(groups)], salt)
            for i, group in enumerate(groups)
        )

    def load(
        self, block_hashes: Sequence[bytes], salt: str | None = None, carried: bool = False
    ) -> list[memoryview | None]:
        """Whole blocks of this engine's grouping (their groups joined), None where any
        group is not servable. (Only a worker's `load_group` reads other groupings.)"""
        groups = [self.group_store(g) for g in grouping(self.heads, self.group_heads)]
        if len(groups) == 1:
            return groups[0].load(block_hashes, salt, carried)
        values = [g.load(block_hashes, salt, carried) for g in groups]
        out: list[memoryview | None] = []
        for parts in zip(*values, strict=True):
            whole = all(p is not None for p in parts)
            out.append(memoryview(b"".join(p for p in parts if p is not None)) if whole else None)
        return out

    # -- one worker's heads --------------------------------------------------------------

    def store_group(
        self,
        block_hashes: Sequence[bytes],
        group: HeadGroup,
        values: Sequence[Payload],
        salt: str | None = None,
    ) -> bool:
        """Each block's `group` heads as one value (one round trip); False if any write
        may have failed."""
        return self.store_group_pieces(block_hashes, group, [[v] for v in values], salt)

    def store_group_pieces(
        self,
        block_hashes: Sequence[bytes],
        group: HeadGroup,
        blocks: Sequence[Sequence[Payload]],
        salt: str | None = None,
    ) -> bool:
        """`store_group`, each value given as the pieces it is end to end (a CPU slot's
        runs in head order): sent as they lie, never joined."""
        if block_hashes and not self.breaker.rejecting():
            self._register(group.count)
        return self.group_store(group).store_pieces(block_hashes, blocks, salt)

    def load_group(
        self,
        block_hashes: Sequence[bytes],
        group: HeadGroup,
        head_bytes: int,
        salt: str | None = None,
        holders: Sequence[int] | None = None,
        carried: bool = False,
    ) -> list[list[memoryview] | None]:
        """Each block's verified heads of `group` (`head_bytes` each) as the runs its
        source values hold, in head order (one run where one value holds them all), None
        where not servable: the caller copies the runs into place, where a join would
        copy every byte once more. Each block's groupings are read in turn, a round trip
        per grouping for the blocks still missing: first the one the lookup found it in
        (`holders`, see `holders_of`), then this group's own values (one GET a block),
        then the other groupings that hold these heads, fewest values first. `carried`:
        the lookup read some of this group's values whole (`prefetch`)."""
        if holders is not None and len(holders) != len(block_hashes):
            raise ValueError(f"{len(holders)} holders for {len(block_hashes)} blocks")
        own = group.count if group.first % group.count == 0 else 0
        orders = [
            _read_order(self.sizes, own, 0 if holders is None else holders[i])
            for i in range(len(block_hashes))
        ]
        values: list[list[memoryview] | None] = [None] * len(block_hashes)
        missing, own_missed = list(range(len(block_hashes))), set[int]()
        for turn in range(len(self.sizes)):
            by_size: dict[int, list[int]] = {}
            for i in missing:
                by_size.setdefault(orders[i][turn], []).append(i)
            for size, ids in by_size.items():
                hashes = [block_hashes[i] for i in ids]
                got: list[list[memoryview] | None]
                if size == own:
                    loaded = self.group_store(group).load(hashes, salt, carried)
                    got = [None if v is None else [v] for v in loaded]
                    own_missed.update(i for i, v in zip(ids, got, strict=True) if v is None)
                else:
                    call = partial(self._read_heads, hashes, group, size, head_bytes, salt)
                    read: list[list[memoryview] | None] | None = self._guarded("load", call, None)
                    if read is None:  # the server gave no answer: the rest is a miss
                        missing = []
                        break
                    got = read
                for i, value in zip(ids, got, strict=True):
                    values[i] = value
            missing = [i for i in missing if values[i] is None]
            if not missing:
                break
        elsewhere = sum(values[i] is not None for i in own_missed)
        if elsewhere:  # counted missing by the own read: found in another grouping after all
            self._counters.add(missing_blocks=-elsewhere)
        return values

    def _read_heads(
        self,
        block_hashes: Sequence[bytes],
        group: HeadGroup,
        size: int,
        head_bytes: int,
        salt: str | None,
    ) -> list[list[memoryview] | None]:
        """`group`'s heads of each block from the values of groups of `size` heads: each
        source's header and its byte range of these heads, one pipelined round trip (one
        GETRANGE where the range follows the header: the source's first heads)."""
        first = group.first // size * size
        sources = [HeadGroup(f, size) for f in range(first, group.end, size)]
        parts = []  # (source's store and codec, the run of `group`'s heads it holds)
        for source in sources:
            start, end = max(source.first, group.first), min(source.end, group.end)
            parts.append((*self._group(source), HeadGroup(start, end - start)))
        hs = header_size(size)
        pipe = self.client.pipeline(transaction=False)
        for block_hash in block_hashes:
            for store, codec, run in parts:
                key = store._keys((block_hash,), salt)[0]
                offset = hs + (run.first - codec.group.first) * head_bytes
                apart = offset > hs  # else the range follows the header: one read
                if apart:
                    pipe.getrange(key, 0, hs - 1)
                pipe.getrange(key, offset if apart else 0, offset + run.count * head_bytes - 1)
        replies = iter(pipe.execute(raise_on_error=False))
        out: list[list[memoryview] | None] = []
        refused: list[bytes] = []
        counts = {"loaded_blocks": 0, "loaded_bytes": 0}
        for block_hash in block_hashes:
            pieces: list[memoryview] = []
            for store, codec, run in parts:
                header, body = _header_and_body(replies, run.first > codec.group.first, hs)
                if not header:
                    continue  # not there: another grouping may hold it
                status, view = codec.verify_heads(block_hash, header, body, run)
                if view is None:
                    refused.append(store._keys((block_hash,), salt)[0])
                    self._counters.add(**{_REFUSED[status]: 1})
                else:
                    pieces.append(view)
            if len(pieces) != len(parts):
                out.append(None)
                continue
            out.append(pieces)
            counts["loaded_blocks"] += 1
            counts["loaded_bytes"] += sum(len(p) for p in pieces)
        self._counters.add(**counts)
        if refused:  # never served again: drop them now
            self.client.delete(*refused)
        return out


def _read_order(sizes: Sequence[int], own: int, holder: int) -> list[int]:
    """The groupings (heads a value) a worker reads a block from, in turn: where the
    lookup found it (`holder`, 0: not known), its own values, the others in `sizes` order."""
    first = [s for s in (holder, own) if s in sizes]
    return [*dict.fromkeys(first), *(s for s in sizes if s not in first)]


def _header_and_body(replies: Iterator[object], apart: bool, hs: int) -> tuple[bytes, memoryview]:
    """A source's header and range from its reply or two (`apart`: header read on its own);
    b"" for the header where the value is not there."""
    header = next(replies)
    body = next(replies) if apart else header
    if not isinstance(header, bytes):  # not there (or not a string value)
        return b"", memoryview(b"")
    body_view = memoryview(body if isinstance(body, bytes) else b"")
    return header[:hs], body_view[0 if apart else hs :]


def split_heads(rows: Sequence[Payload], heads: int) -> list[memoryview]:
    """Each row cut into `heads` equal views, row by row (no copy)."""
    out: list[memoryview] = []
    for row in rows:
        view = memoryview(row).cast("B")
        if len(view) % heads:
            raise ValueError(f"a block of {len(view)} bytes does not cut into {heads} heads")
        size = len(view) // heads
        out.extend(view[i * size : (i + 1) * size] for i in range(heads))
    return out


__all__ = ["HeadGroup", "HeadKeyedStore", "grouping", "split_heads"]
