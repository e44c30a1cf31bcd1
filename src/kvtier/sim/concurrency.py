"""The concurrency model: requests overlap by arrival time on virtual time.

The sequential replay completes every load and store before the next request
arrives, which flatters a cache: in a server, a prefix being computed by one
request is not yet readable by the next one, and blocks being read are pinned
(never evicted). Here each request's loads and stores stay in flight for the
length of its prefill, given by a simple time model; other requests arriving
meanwhile see those blocks as not ready (lookup stops there) and cannot evict
them (a store that would need to is refused and counted).

Time is virtual (the trace's timestamps, in ms): runs are reproducible and fast.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvtier.offload.abstract import OffloadingManager
from kvtier.sim.metrics import TierCounters, served_tokens
from kvtier.sim.workload import Workload
from kvtier.types import BlockHash


@dataclass(frozen=True)
class TimeModel:
    """Prefill cost: a fixed overhead plus uncached tokens at a prefill rate.

    Loading an offloaded block is taken to cost `load_ms_per_block` (the transfer is
    overlapped with nothing, a pessimistic but simple choice). Decode time is
    `output_length / decode_tokens_per_s`; it matters only to the accelerator tier,
    whose blocks a request holds until it finishes.
    """

    prefill_tokens_per_s: float = 20_000.0
    prefill_overhead_ms: float = 5.0
    load_ms_per_block: float = 0.05
    decode_tokens_per_s: float = 40.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_tokens_per_s <= 0:
            raise ValueError(
                "token rates must be > 0, got "
                f"{self.prefill_tokens_per_s} and {self.decode_tokens_per_s}"
            )
        if self.prefill_overhead_ms < 0 or self.load_ms_per_block < 0:
            raise ValueError("times must be >= 0")

    def prefill_ms(self, uncached_tokens: int, loaded_blocks: int) -> float:
        return (
            self.prefill_overhead_ms
            + 1000.0 * uncached_tokens / self.prefill_tokens_per_s
            + self.load_ms_per_block * loaded_blocks
        )

    def decode_ms(self, output_tokens: int) -> float:
        return 1000.0 * output_tokens / self.decode_tokens_per_s


# A pending completion: (virtual time, sequence number, hashes loaded, hashes stored).
_Pending = tuple[float, int, list[BlockHash], list[BlockHash]]


def concurrent_offload_loop(
    workload: Workload, manager: OffloadingManager, c: TierCounters, model: TimeModel
) -> tuple[int, int, int, int]:
    """The offload-only replay with in-flight loads and stores; same tallies as sequential."""
    bs = workload.block_size
    pending: list[_Pending] = []
    ready: set[BlockHash] = set()  # readable blocks: any-position hits
    resident: set[BlockHash] = set()  # ready or in flight: what prepare_store skips
    any_hits = prefix_hits = hit_tokens = saved = 0
    for seq, (request, hs) in enumerate(zip(workload.requests, workload.block_hashes, strict=True)):
        now = request.timestamp
        while pending and pending[0][0] <= now:
            _, _, done_loads, done_stores = heapq.heappop(pending)
            manager.complete_load(done_loads)
            manager.complete_store(done_stores)
            ready.update(done_stores)
        any_hits += len(ready.intersection(hs))
        hit = manager.lookup(hs) or 0
        loaded = hs[:hit]
        if hit:
            manager.prepare_load(loaded)
            prefix_hits += hit
            tokens, saved_tokens = served_tokens(hit, bs, request.input_length)
            hit_tokens += tokens
            saved += saved_tokens
        manager.touch(hs)
        stored: list[BlockHash] = []
        evicted: list[BlockHash]
        if hit < len(hs):
            absent = len(hs) - len(resident.intersection(hs))
            out = manager.prepare_store(hs[hit:])
            if out is None:
                c.store_rejections += 1
            else:
                stored, evicted = out.block_hashes_to_store, out.block_hashes_evicted
                c.stores += len(stored)
                c.evictions += len(evicted)
                c.filtered_stores += absent - len(stored)
                ready.difference_update(evicted)
                resident.difference_update(evicted)
                resident.update(stored)
        uncached = max(0, request.input_length - hit * bs)
        heapq.heappush(pending, (now + model.prefill_ms(uncached, hit), seq, loaded, stored))
    for _, _, loaded, stored in sorted(pending):
        manager.complete_load(loaded)
        manager.complete_store(stored)
    return any_hits, prefix_hits, hit_tokens, saved
