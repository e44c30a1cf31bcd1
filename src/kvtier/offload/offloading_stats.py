"""What an offloading manager has done, as one immutable snapshot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OffloadingStats:
    lookups: int = 0  # lookup calls
    queried_blocks: int = 0  # hashes passed to lookup
    hit_blocks: int = 0  # leading hashes found present and ready
    loaded_blocks: int = 0  # blocks pinned by prepare_load
    stored_blocks: int = 0  # blocks made ready by complete_store
    evicted_blocks: int = 0
    store_rejections: int = 0  # prepare_store calls answered None
    failed_stores: int = 0  # blocks dropped by complete_store(success=False)
    filtered_out: int = 0  # hashes a reuse filter kept from prepare_store
