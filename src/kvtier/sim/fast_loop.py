"""The offload-only replay of one bare CPU tier, specialised for speed.

It makes the same calls in the same order as the general step (`kvtier.sim.step`)
with no bytes and every completion at once, and the tests hold it to the same
figures; it exists because it is also the throughput benchmark of the managers
underneath (`benchmarks/bench_replay.py` measures it against the general step).
Hashes are packed once per workload, there are no per-block objects, bound methods
are hoisted, and presence is counted from the manager's own answers: a bare CPU
manager stores every absent block it is offered, so what it did not take, it had.
"""

from __future__ import annotations

from kvtier.offload.abstract import OffloadingManager
from kvtier.sim.ledger import Ledger
from kvtier.sim.metrics import served_tokens
from kvtier.sim.replay_config import PROGRESS_EVERY, Progress


def fast_offload_loop(
    manager: OffloadingManager, ledger: Ledger, progress: Progress | None = None
) -> None:
    """lookup -> load hits -> touch all -> store the rest -> complete, per request;
    the figures go to `ledger`'s "cpu" tier."""
    # One function on purpose: this is the benchmarked hot loop (no calls to split it).
    workload = ledger.workload
    lookup, prepare_load, complete_load = (
        manager.lookup,
        manager.prepare_load,
        manager.complete_load,
    )
    touch, prepare_store, complete_store = (
        manager.touch,
        manager.prepare_store,
        manager.complete_store,
    )
    bs = workload.block_size
    any_hits = prefix_hits = hit_tokens = saved = 0
    stores = evictions = rejections = 0
    hashes = workload.block_hashes
    for i, (request, hs) in enumerate(zip(workload.requests, hashes, strict=True)):
        n = len(hs)
        hit = lookup(hs) or 0
        if hit:
            loaded = hs[:hit]
            prepare_load(loaded)
            touch(hs)
            complete_load(loaded)
            prefix_hits += hit
            tokens, saved_tokens = served_tokens(hit, bs, request.input_length)
            hit_tokens += tokens
            saved += saved_tokens
        else:
            touch(hs)
        if hit < n:
            out = prepare_store(hs[hit:])
            if out is None:
                rejections += 1
                # rare (a request larger than the tier): ask block by block
                any_hits += hit + sum(lookup([h]) or 0 for h in hs[hit:])
            else:
                stored = out.block_hashes_to_store
                complete_store(stored)
                stores += len(stored)
                evictions += len(out.block_hashes_evicted)
                any_hits += n - len(stored)
        else:
            any_hits += n
        if progress is not None and i % PROGRESS_EVERY == 0:
            progress(i)
    cpu = ledger.tiers["cpu"]
    cpu.hit_blocks += prefix_hits
    cpu.hit_tokens += hit_tokens
    cpu.stores += stores
    cpu.evictions += evictions
    cpu.store_rejections += rejections
    ledger.any_hits += any_hits
    ledger.prefill_tokens_saved += saved
