"""Which engine holds which block in which tier, as its KV events tell.

Counts, not sets: vLLM can announce the same hash more than once (two pool blocks
computed with the same content, an offloaded chunk re-announced; vLLM's offloading
events ask consumers to reference-count), and a block is held while its stores
outnumber its removals. A removal of a block never stored (missed events, an index
rebuilt mid-stream) is ignored.

A block in the shared tier (kvtier's Redis) is held for every engine: any of them
can load it. An engine's entries are dropped when it restarts or stops answering,
since no removal will ever come for them; "all blocks cleared" (vLLM's prefix-cache
reset) drops what the engine held itself and keeps the shared tier, which a reset
does not touch.

Routed, not yet announced: a prompt the router has just sent to an engine is taken as
held in that engine's pool until the engine's events speak for its blocks (`routed`).
An engine announces a prefill's blocks from its own process, and on a busy machine the
events can reach the router after the answer does: a conversation's next turn, sent at
once, then found nothing and went to whichever engine was least loaded (seen in the
router's engine test under the full suite's load). Any event naming the block on that
engine (stored or removed), a reset or the engine's loss ends the guess, and so does
`ttl_s` with no event (the engine may have dropped the request).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from kvtier.router.tiers import EventHash, Tier, TierEvent

_NO_TIERS: dict[Tier, int] = {}
# blocks routed and not yet announced, per engine (the oldest guess goes first)
MAX_ROUTED = 1 << 16


class BlockIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._held: dict[str, dict[EventHash, dict[Tier, int]]] = {}
        self._shared: dict[EventHash, int] = {}  # announcements over all engines
        self._int_hashes: dict[str, bool] = {}
        # engine -> a routed block's integer form -> until when it is taken as held
        self._routed: dict[str, OrderedDict[int, float]] = {}
        self._clock = clock

    @property
    def engines(self) -> list[str]:
        return list(self._held)

    def apply(self, engine: str, event: TierEvent) -> None:
        if event.kind == "cleared":
            self.clear(engine)
        elif event.tier is None:
            raise ValueError(f"a {event.kind!r} event needs a tier")
        elif event.kind == "stored":
            self.stored(engine, event.tier, event.block_hashes)
        elif event.kind == "removed":
            self.removed(engine, event.tier, event.block_hashes)
        else:
            raise ValueError(f"unknown event kind {event.kind!r}; known: stored, removed, cleared")

    def routed(self, engine: str, hashes: Sequence[bytes], ttl_s: float) -> None:
        """`engine` was just sent a prompt of these blocks (sha256 hashes): they count as
        in its pool until an event names them, for at most `ttl_s` (see the module
        docstring); 0 guesses nothing."""
        if ttl_s <= 0 or not hashes:
            return
        until = self._clock() + ttl_s
        routed = self._routed.setdefault(engine, OrderedDict())
        for h in hashes:
            key = int_form(h)
            routed[key] = until
            routed.move_to_end(key)
        while len(routed) > MAX_ROUTED:
            routed.popitem(last=False)

    def _announced(self, engine: str, hashes: Iterable[EventHash]) -> list[EventHash]:
        """The hashes, after ending the routed guesses their event speaks for."""
        hashes = list(hashes)
        routed = self._routed.get(engine)
        if routed:
            for h in hashes:
                routed.pop(h if isinstance(h, int) else int_form(h), None)
        return hashes

    def _routed_until(self, engine: str, block_hash: bytes) -> bool:
        routed = self._routed.get(engine)
        if not routed:
            return False
        key = int_form(block_hash)
        until = routed.get(key)
        if until is None:
            return False
        if until < self._clock():
            del routed[key]
            return False
        return True

    def stored(self, engine: str, tier: Tier, hashes: Iterable[EventHash]) -> None:
        held = self._held.setdefault(engine, {})
        for h in self._announced(engine, hashes):
            if isinstance(h, int):
                self._int_hashes[engine] = True
            tiers = held.setdefault(h, {})
            tiers[tier] = tiers.get(tier, 0) + 1
            if tier is Tier.SHARED:
                self._shared[h] = self._shared.get(h, 0) + 1

    def removed(self, engine: str, tier: Tier, hashes: Iterable[EventHash]) -> None:
        hashes = self._announced(engine, hashes)
        held = self._held.get(engine)
        if held is None:
            return
        for h in hashes:
            tiers = held.get(h)
            if tiers is None or tier not in tiers:
                continue
            self._forget(held, h, tiers, tier, 1)

    def clear(self, engine: str) -> None:
        """vLLM's AllBlocksCleared: the engine's own tiers are empty, the shared one is not."""
        self._routed.pop(engine, None)
        held = self._held.get(engine, {})
        for h in list(held):
            tiers = held[h]
            for tier in [t for t in tiers if t is not Tier.SHARED]:
                self._forget(held, h, tiers, tier, tiers[tier])

    def drop_engine(self, engine: str, keep_routed: bool = False) -> None:
        """Forget everything the engine announced (restarted, or its events stopped).

        `keep_routed`: the router's own guesses stay (an events stream rebuilt from
        the engine's replay buffer: a prompt routed while the subscriber rebuilt, or
        before its first batch came, is still on its way to the engine's pool; a
        router starting under load lost the first request's guess to its own
        subscriber's start)."""
        if not keep_routed:
            self._routed.pop(engine, None)
        for h, tiers in self._held.pop(engine, {}).items():
            count = tiers.get(Tier.SHARED, 0)
            if count:
                self._unshare(h, count)
        self._int_hashes.pop(engine, None)

    def _forget(
        self,
        held: dict[EventHash, dict[Tier, int]],
        h: EventHash,
        tiers: dict[Tier, int],
        tier: Tier,
        count: int,
    ) -> None:
        left = tiers[tier] - count
        if left > 0:
            tiers[tier] = left
        else:
            del tiers[tier]
            if not tiers:
                del held[h]
        if tier is Tier.SHARED:
            self._unshare(h, count)

    def _unshare(self, h: EventHash, count: int) -> None:
        left = self._shared[h] - count
        if left > 0:
            self._shared[h] = left
        else:
            del self._shared[h]

    def best_tier(self, engine: str, block_hash: EventHash) -> Tier | None:
        """The fastest tier `engine` can load the block from (the shared tier counts for
        every engine), or None."""
        tiers = self._held.get(engine, {}).get(block_hash, _NO_TIERS)
        if tiers:
            return min(tiers)
        return Tier.SHARED if block_hash in self._shared else None

    def prefix_tiers(self, engine: str, hashes: Sequence[bytes]) -> list[Tier]:
        """Each block of the longest prefix the engine can serve, with its best tier.

        `hashes` are the prompt's sha256 block hashes; an engine that publishes 64-bit
        integer hashes is asked for vLLM's integer form of each. A block no event
        names, routed to the engine moments ago, counts as in its pool (`routed`)."""
        as_int = self._int_hashes.get(engine, False)

        def tier_of(h: bytes) -> Tier | None:
            tier = self.best_tier(engine, int_form(h) if as_int else h)
            if tier is not Tier.GPU and self._routed_until(engine, h):
                return Tier.GPU
            return tier

        return prefix_tiers_by(hashes, tier_of)

    def held_blocks(self, engine: str) -> int:
        return len(self._held.get(engine, {}))

    def shared_blocks(self) -> int:
        return len(self._shared)


H = TypeVar("H", bound=bytes)


def prefix_tiers_by(hashes: Sequence[H], tier_of: Callable[[H], Tier | None]) -> list[Tier]:
    """The tier of each block up to the first that `tier_of` finds nowhere: what the
    router and the multi-engine replay both score."""
    out: list[Tier] = []
    for h in hashes:
        tier = tier_of(h)
        if tier is None:
            break
        out.append(tier)
    return out


def int_form(block_hash: bytes) -> int:
    """vLLM's integer form of a block hash (`maybe_convert_block_hash`: the low 64 bits)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def apply_all(index: BlockIndex, engine: str, events: Iterable[TierEvent]) -> None:
    for event in events:
        index.apply(engine, event)
