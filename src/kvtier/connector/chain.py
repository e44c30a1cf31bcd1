"""Offload tiers in order (fastest first) behind one `OffloadingManager`.

The connector talks to one manager; an engine with a CPU tier (or the CPU+disk
cascade) and a shared Redis tier below it uses this chain:

- `lookup` finds the prefix that some tier holds block by block, each block served by
  the fastest tier that holds it (as an engine asking key by key, kvtier's vLLM
  adapter, chooses);
- `prepare_load` splits the hit run into runs by tier (those of the matching lookup), and
  `complete_load` promotes blocks served by a lower tier into the tiers above it,
  so the next hit is local;
- `prepare_store` writes through: every tier is offered the blocks (each skips what
  it holds), so a shared remote tier sees every computed prefix;
- `touch` reaches every tier.

It keeps a mirror of each tier's contents (so a store is not offered to a lower
tier as "evicted" while an upper one still holds it) and counts, per tier, the
stores that tier refused while others took them; what each tier served and stored
is for the caller to read from the tiers' own events.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.offload.abstract import LoadStoreSpec, OffloadingManager, PrepareStoreOutput
from kvtier.offload.cascade_manager import CascadeOffloadingManager
from kvtier.types import BlockHash


@dataclass
class ChainSpec(LoadStoreSpec):
    """One spec per tier involved: (tier name, hashes, that tier's spec)."""

    parts: list[tuple[str, list[BlockHash], LoadStoreSpec]] = field(default_factory=list)

    @staticmethod
    def medium() -> str:
        return "CHAIN"


class TierChain(OffloadingManager):
    def __init__(
        self, tiers: Sequence[tuple[str, OffloadingManager]], promote: bool = True
    ) -> None:
        names = [name for name, _ in tiers]
        if not tiers or len(set(names)) != len(names):
            raise ValueError(f"a chain needs at least one tier and distinct names, got {names}")
        self.tiers = list(tiers)
        self.promote = promote
        self.rejections: Counter[str] = Counter()  # tier -> stores it refused
        self.resident: list[set[BlockHash]] = [set() for _ in tiers]
        self._last: tuple[list[BlockHash], list[tuple[int, int]]] = ([], [])
        self._loads: defaultdict[tuple[BlockHash, ...], deque[list[tuple[int, list[BlockHash]]]]]
        self._loads = defaultdict(deque)
        self._stores: dict[BlockHash, list[int]] = {}  # in flight -> tiers storing it

    def forget(self) -> None:
        """Drop what the chain knows of its tiers (they were reset): their contents and
        the loads and stores in flight, whose completions are then ignored."""
        for resident in self.resident:
            resident.clear()
        self._loads.clear()
        self._stores.clear()
        self._last = ([], [])

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        hashes = list(block_hashes)
        runs = self._runs(hashes)
        self._last = (hashes, runs)
        return sum(count for _, count in runs)

    def _runs(self, hashes: list[BlockHash]) -> list[tuple[int, int]]:
        """The prefix as runs of (tier, blocks), each block from the fastest tier holding
        it, as an engine asks key by key: a block a lower tier serves may be followed by
        one an upper tier holds. Each tier is asked for the run from where it is needed
        (one round trip for a remote tier), the upper tiers block by block inside it."""
        runs: list[tuple[int, int]] = []
        start = 0
        while start < len(hashes):
            # "ask again" from a tier is a miss here
            found = ((k, m.lookup(hashes[start:]) or 0) for k, (_, m) in enumerate(self.tiers))
            k, count = next(((k, n) for k, n in found if n), (0, 0))
            if not count:
                break
            for h in hashes[start : start + count]:
                tier = next((u for u in range(k) if self.tiers[u][1].lookup([h])), k)
                if runs and runs[-1][0] == tier:
                    runs[-1] = (tier, runs[-1][1] + 1)
                else:
                    runs.append((tier, 1))
            start += count
        return runs

    def _split(self, hashes: list[BlockHash]) -> list[tuple[int, int]]:
        last, runs = self._last
        if last[: len(hashes)] != hashes:
            self.lookup(hashes)
            last, runs = self._last
        split, left = [], len(hashes)
        for k, count in runs:
            if left:
                split.append((k, min(count, left)))
                left -= split[-1][1]
        if left:
            raise KeyError(f"prepare_load: {left} of {len(hashes)} blocks are in no tier")
        return split

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        hashes = list(block_hashes)
        spec, parts, start = ChainSpec(), [], 0
        try:
            for k, count in self._split(hashes):
                part = hashes[start : start + count]
                name, manager = self.tiers[k]
                spec.parts.append((name, part, manager.prepare_load(part)))
                parts.append((k, part))
                start += count
        except BaseException:  # a tier refused its part: unpin the parts taken above it
            for k, part in parts:
                self.tiers[k][1].complete_load(part)
            raise
        self._loads[tuple(hashes)].append(parts)
        return spec

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        hashes = list(block_hashes)
        for _, manager in self.tiers:
            manager.touch(hashes)

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Unpin every part; promote only what a successful load brought up."""
        key = tuple(block_hashes)
        pending = self._loads.get(key)
        if not pending:
            raise KeyError(f"complete_load: no load in flight for these {len(key)} blocks")
        parts = pending.popleft()
        if not pending:
            del self._loads[key]
        for k, part in parts:
            settle_load(self.tiers[k][1], part, success)
            if self.promote and success:
                for upper in range(k):
                    self._promote(upper, part)

    def _promote(self, k: int, hashes: list[BlockHash]) -> None:
        out = self.plan_promotion(k, hashes)
        if out is not None:
            self.settle_promotion(k, out.block_hashes_to_store, True)

    def plan_promotion(self, k: int, hashes: list[BlockHash]) -> PrepareStoreOutput | None:
        """Copy up into tier `k` blocks a lower tier served (with `promote=False`, for a
        caller that moves the bytes itself); settle with `settle_promotion`."""
        out = self.tiers[k][1].prepare_store(hashes)
        if out is not None:
            self._account(k, out)
        return out

    def settle_promotion(self, k: int, hashes: list[BlockHash], success: bool) -> None:
        self.tiers[k][1].complete_store(hashes, success)
        if success:
            self.resident[k].update(hashes)

    def _account(self, k: int, out: PrepareStoreOutput) -> None:
        self.resident[k].difference_update(out.block_hashes_evicted)

    def _anywhere(self, block_hash: BlockHash) -> bool:
        return any(block_hash in r for r in self.resident) or block_hash in self._stores

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """Offer the blocks to every tier. To store: what any tier will store (complete
        them all with `complete_store`); evicted: blocks that left every tier."""
        hashes = list(block_hashes)
        stored: dict[BlockHash, None] = {}  # every tier's new blocks, in order
        evicted: list[BlockHash] = []
        parts: list[tuple[str, list[BlockHash], LoadStoreSpec]] = []
        accepted = False
        for k, (name, manager) in enumerate(self.tiers):
            out = manager.prepare_store(hashes)
            if out is None:
                self.rejections[name] += 1
                continue
            accepted = True
            self._account(k, out)
            evicted += out.block_hashes_evicted
            parts.append((name, out.block_hashes_to_store, out.store_spec))
            for h in out.block_hashes_to_store:
                self._stores.setdefault(h, []).append(k)
                stored[h] = None
        if not accepted:
            return None
        gone = [h for h in dict.fromkeys(evicted) if not self._anywhere(h)]
        return PrepareStoreOutput(list(stored), ChainSpec(parts), gone)

    def complete_part(
        self, name: str, block_hashes: Iterable[BlockHash], success: bool
    ) -> list[BlockHash]:
        """Settle one tier's part of the stores (its own transfer job succeeded or not);
        the hashes that tier was storing, now settled."""
        k = [n for n, _ in self.tiers].index(name)
        # a hash listed twice is one store (settled once)
        hashes = [h for h in dict.fromkeys(block_hashes) if k in self._stores.get(h, ())]
        if not hashes:  # this tier stores none of them
            return hashes
        for h in hashes:
            self._stores[h].remove(k)
            if not self._stores[h]:
                del self._stores[h]
        self.tiers[k][1].complete_store(hashes, success)
        if success:
            self.resident[k].update(hashes)
        return hashes

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Settle every tier's part of the stores of these hashes."""
        by_tier: defaultdict[int, list[BlockHash]] = defaultdict(list)
        for h in block_hashes:
            for k in self._stores.pop(h, ()):
                by_tier[k].append(h)
        for k, hashes in by_tier.items():
            self.tiers[k][1].complete_store(hashes, success)
            if success:
                self.resident[k].update(hashes)


def settle_load(manager: OffloadingManager, block_hashes: list[BlockHash], success: bool) -> None:
    """`complete_load`, telling the managers that settle more than pins (promotions
    riding on the load: the cascade, a chain) whether the load's bytes arrived."""
    if isinstance(manager, CascadeOffloadingManager | TierChain):
        manager.complete_load(block_hashes, success)
    else:
        manager.complete_load(block_hashes)
