"""Decoding vLLM's event batches: media to tiers, and what is skipped and counted."""

from __future__ import annotations

import msgspec
import pytest

from kvtier.router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecoder,
    encode_batch,
    tier_of,
)
from kvtier.router.tiers import Tier, TierEvent

H = [bytes([i]) * 32 for i in range(3)]


def _stored(medium: str | None, locality: str | None = None, **kw: object) -> BlockStored:
    fields: dict[str, object] = {
        "block_hashes": H[:2],
        "parent_block_hash": None,
        "token_ids": [1] * 32,
        "block_size": 16,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "locality": locality,
    }
    return BlockStored(**(fields | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("medium", "locality", "tier"),
    [
        (None, None, Tier.GPU),
        ("GPU", None, Tier.GPU),
        ("CPU", "LOCAL", Tier.CPU),
        ("STORAGE", "LOCAL", Tier.DISK),
        ("STORAGE", None, Tier.DISK),
        ("STORAGE", "REMOTE", Tier.SHARED),
        ("CPU", "REMOTE", Tier.SHARED),  # kvtier's Redis secondary tier says CPU/REMOTE
        ("TAPE", None, None),
    ],
)
def test_media_map_onto_tiers(medium: str | None, locality: str | None, tier: Tier | None) -> None:
    assert tier_of(medium, locality) is tier


def test_a_batch_decodes_in_order() -> None:
    payload = encode_batch(
        [_stored("CPU", "LOCAL"), BlockRemoved(block_hashes=[7], medium="GPU"), AllBlocksCleared()],
        1.5,
    )
    batch = EventDecoder().decode(payload)
    assert batch.events == [
        TierEvent("stored", Tier.CPU, tuple(H[:2])),
        TierEvent("removed", Tier.GPU, (7,)),
        TierEvent("cleared"),
    ]
    assert (batch.malformed, batch.ignored) == (0, 0)


def test_a_malformed_event_is_counted_and_the_rest_kept() -> None:
    good = msgspec.to_builtins(_stored("GPU"), builtin_types=(bytes,))
    good["type"] = "BlockStored"
    broken = {"type": "BlockStored", "block_hashes": "not a list"}
    unknown = {"type": "BlockTeleported"}
    payload = msgspec.msgpack.encode([0.0, [broken, good, unknown, {"nothing": 1}]])
    batch = EventDecoder().decode(payload)
    assert batch.malformed == 3
    assert batch.events == [TierEvent("stored", Tier.GPU, tuple(H[:2]))]


def test_other_kv_cache_groups_are_ignored_and_unknown_fields_too() -> None:
    raw = msgspec.to_builtins(_stored("GPU", group_idx=1), builtin_types=(bytes,))
    raw["type"] = "BlockStored"
    later = dict(raw, group_idx=0, a_field_from_a_later_vllm=3)
    batch = EventDecoder().decode(msgspec.msgpack.encode([0.0, [raw, later], 0]))
    assert (batch.ignored, batch.malformed, len(batch.events)) == (1, 0, 1)


def test_a_broken_batch_raises() -> None:
    with pytest.raises(msgspec.DecodeError):
        EventDecoder().decode(b"\xc1")
