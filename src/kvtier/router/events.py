"""vLLM's KV events as its ZMQ publisher sends them, decoded with msgspec.

vLLM (`vllm/distributed/kv_events.py`) encodes a `KVEventBatch` with
`msgspec.msgpack.Encoder`: the batch is an array `[ts, events, data_parallel_rank]`
and each event a map tagged by its class name under "type" (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared`), defaults omitted. The structs below declare the
same shapes, so decoding needs msgspec but not vLLM; fields vLLM adds later are
ignored. Each event is decoded on its own: a malformed one is counted and skipped
without losing the rest of its batch.

Media and localities map onto the router's tiers: the engine's pool is `GPU` (also
on vLLM's CPU platform), kvtier's CPU tier `CPU`, its disk tier `STORAGE`/`LOCAL`
and its shared Redis tier `REMOTE` (any medium): a block there can be loaded by
every engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvtier.router.tiers import EventHash, Tier, TierEvent


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[EventHash]
    parent_block_hash: EventHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[EventHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_MEDIA = {None: Tier.GPU, "GPU": Tier.GPU, "CPU": Tier.CPU, "STORAGE": Tier.DISK}


@dataclass
class DecodedBatch:
    events: list[TierEvent]
    malformed: int  # events that did not decode or named an unknown medium
    ignored: int  # well-formed events the router does not use (other KV-cache groups)


class EventDecoder:
    """Decodes one publisher payload (the third frame of its multipart message)."""

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(_RawBatch)
        self._event = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)

    def decode(self, payload: bytes) -> DecodedBatch:
        """Raises `msgspec.DecodeError` (a ValueError) when the batch itself is broken."""
        batch = self._batch.decode(payload)
        out = DecodedBatch([], 0, 0)
        for raw in batch.events:
            try:
                event = self._event.decode(raw)
            except msgspec.DecodeError:
                out.malformed += 1
                continue
            if isinstance(event, AllBlocksCleared):
                out.events.append(TierEvent("cleared"))
                continue
            if event.group_idx not in (None, 0):
                out.ignored += 1
                continue
            tier = tier_of(event.medium, event.locality)
            if tier is None:
                out.malformed += 1
                continue
            kind = "stored" if isinstance(event, BlockStored) else "removed"
            out.events.append(TierEvent(kind, tier, tuple(event.block_hashes)))
        return out


def tier_of(medium: str | None, locality: str | None) -> Tier | None:
    """The router's tier for an event's medium and locality; None for an unknown medium."""
    if locality == "REMOTE":
        return Tier.SHARED
    return _MEDIA.get(medium)


def encode_batch(events: list[BlockStored | BlockRemoved | AllBlocksCleared], ts: float) -> bytes:
    """A payload as vLLM's publisher encodes it (for tests, benchmarks and fake engines)."""
    return msgspec.msgpack.encode(EventBatch(ts, events))
