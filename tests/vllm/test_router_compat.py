"""The router reads what vLLM itself writes: event batches encoded by vLLM's own
classes and encoder, offloading events as vLLM translates kvtier's media, and block
hashes as vLLM's prefix cache computes them."""

from __future__ import annotations

import pytest

from kvtier.router.events import EventDecoder
from kvtier.router.prompts import PromptHasher
from kvtier.router.tiers import Tier, TierEvent
from tests.vllm.needs_vllm import quiet, require_vllm

require_vllm()

with quiet():
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        _MEDIUM_TO_EVENT_STR,
    )
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils

    from kvtier.vllm.offloading.kvtier_manager import _MEDIA

H = [bytes([i]) * 32 for i in range(4)]


def _vllm_payload(events: list[object]) -> bytes:
    batch = KVEventBatch(ts=1.0, events=events, data_parallel_rank=0)
    return msgspec.msgpack.Encoder().encode(batch)


@pytest.mark.parametrize(("kvtier_medium", "tier"), [("CPU", Tier.CPU), ("DISK", Tier.DISK),
                                                     ("REMOTE", Tier.SHARED)])  # fmt: skip
def test_kvtiers_media_reach_the_router_as_their_tiers(kvtier_medium: str, tier: Tier) -> None:
    medium, locality = _MEDIA[kvtier_medium]
    stored = BlockStored(
        block_hashes=H[:2], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
        medium=_MEDIUM_TO_EVENT_STR[medium], lora_name=None, group_idx=0,
        locality=locality.value,
    )  # fmt: skip
    removed = BlockRemoved(
        block_hashes=H[:1], medium=_MEDIUM_TO_EVENT_STR[medium], group_idx=0,
        locality=locality.value,
    )  # fmt: skip
    batch = EventDecoder().decode(_vllm_payload([stored, removed, AllBlocksCleared()]))
    assert batch.events == [
        TierEvent("stored", tier, tuple(H[:2])),
        TierEvent("removed", tier, tuple(H[:1])),
        TierEvent("cleared"),
    ]
    assert batch.malformed == 0


def test_the_pools_events_with_every_field_vllm_fills() -> None:
    stored = BlockStored(
        block_hashes=H[:2], parent_block_hash=H[3], token_ids=list(range(32)), block_size=16,
        lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, ("salt",)], group_idx=0,
        kv_cache_spec_kind="full_attention", session_id="s",
    )  # fmt: skip
    batch = EventDecoder().decode(_vllm_payload([stored]))
    assert batch.events == [TierEvent("stored", Tier.GPU, tuple(H[:2]))]


def test_prompt_hashes_are_vllms_sha256_cbor_block_hashes() -> None:
    kv_cache_utils.init_none_hash(sha256_cbor)
    tokens = list(range(1000, 1000 + 5 * 32 + 7))
    parent = None
    expected = []
    for k in range(5):
        parent = kv_cache_utils.hash_block_tokens(
            sha256_cbor, parent, tokens[k * 32 : (k + 1) * 32], None
        )
        expected.append(bytes(parent))
    assert PromptHasher(32).hashes("/v1/completions", {"prompt": tokens}) == expected
    # a seed given to the router stands for the engines' PYTHONHASHSEED
    seeded = kv_cache_utils.hash_block_tokens(
        sha256_cbor, kv_cache_utils.BlockHash(sha256_cbor("7")), tokens[:32], None
    )
    assert PromptHasher(32, hash_seed="7").hashes("/v1/completions", {"prompt": tokens})[0] == (
        bytes(seeded)
    )
