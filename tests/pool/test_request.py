"""Request: cached, incremental block hashes; the constructor from precomputed hashes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvtier.request
from kvtier import Request
from kvtier.hashing import hash_request_blocks
from kvtier.types import int_block_hash


def test_hashes_match_the_plain_function_with_options() -> None:
    tokens = list(range(40))
    request = Request(
        "r", tokens, cache_salt="s", lora_name="l", lora_path="p", mm_inputs=[("img", 5, 10)]
    )
    expected = hash_request_blocks(
        tokens, 8, cache_salt="s", lora_name="l", lora_path="p", mm_inputs=[("img", 5, 10)]
    )
    assert request.get_block_hashes(8, "sha256_cbor") == expected


def test_decode_hashes_only_new_full_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    real = kvtier.request.hash_blocks

    def spy(spec: Any, tokens: Any, parent: Any, first_block: int) -> Any:
        calls.append((first_block, len(tokens)))
        return real(spec, tokens, parent, first_block)

    monkeypatch.setattr(kvtier.request, "hash_blocks", spy)
    request = Request("r", list(range(10)), block_size=4)
    assert len(request.block_hashes) == 2
    request.append_output_token_ids([100, 101])
    assert len(request.block_hashes) == 3  # tokens 8..11 now full
    request.append_output_token_ids(np.int64(102))  # one token, as a sampler returns it
    assert len(request.block_hashes) == 3  # nothing new: no hashing call
    assert calls == [(0, 10), (2, 4)]
    assert list(request.block_hashes) == hash_request_blocks([*range(10), 100, 101, 102], 4)


def test_other_block_size_rehashes() -> None:
    request = Request("r", list(range(12)), block_size=4)
    assert len(request.block_hashes) == 3
    assert request.get_block_hashes(6, "sha256_cbor") == hash_request_blocks(list(range(12)), 6)


def test_from_block_hashes_full_blocks_only() -> None:
    hashes = [int_block_hash(i) for i in range(3)]
    exact = Request.from_block_hashes("t", hashes, 1536, block_size=512)
    assert list(exact.block_hashes) == hashes and exact.num_tokens == 1536
    with pytest.raises(ValueError, match="full blocks only"):
        Request.from_block_hashes("t", hashes, 1000, block_size=512)
    ok = Request.from_block_hashes("t", hashes[:1], 1000, block_size=512)
    assert list(ok.block_hashes) == hashes[:1]
    ok.append_output_token_ids([1] * 100)
    assert ok.num_tokens == 1100 and list(ok.block_hashes) == hashes[:1]
    assert not ok.has_token_ids
    with pytest.raises(ValueError, match="built from block hashes"):
        _ = ok.all_token_ids
    with pytest.raises(ValueError, match="not 16"):
        ok.get_block_hashes(16, "sha256_cbor")


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("", [1]), {}, "request_id"),
        (("r", []), {}, "at least 1 prompt token"),
        (("r", [1, 2]), {"lora_path": "/p"}, "without a lora_name"),
        (("r", [1, 2]), {"mm_inputs": [("i", 1, 5)]}, "ends after the prompt"),
        (("r", [1] * 20), {"mm_inputs": [("a", 10, 5), ("b", 12, 1)]}, "position order"),
        (("r", np.array([1.5])), {}, "integers"),
    ],
)
def test_bad_requests(args: tuple[Any, ...], kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Request(*args, **kwargs)


def test_block_hashes_need_a_block_size() -> None:
    with pytest.raises(ValueError, match="no block size"):
        _ = Request("r", [1, 2, 3]).block_hashes


def test_token_views() -> None:
    request = Request("r", np.arange(5))
    request.append_output_token_ids([9, 8])
    assert list(request.prompt_token_ids) == [0, 1, 2, 3, 4]
    assert list(request.output_token_ids) == [9, 8]
    assert request.num_tokens == 7 and request.num_output_tokens == 2


@pytest.mark.parametrize(
    ("tokens", "bad"),
    [
        (["a"] * 40, "token 0 is 'a'"),
        ([1, 2, 3.0], "token 2 is 3.0"),
        ([1, None], "token 1 is None"),
        ([5, -(2**31) - 1], "token 1 is -2147483649"),
        ([2**32], "token 0 is 4294967296"),
        ([2**70], "token 0 is 1180591620717411303424"),
        ("abc", "must be a sequence of integers"),
    ],
)
def test_bad_token_ids_are_refused_before_any_allocation(tokens: Any, bad: str) -> None:
    """Issue 15 item 3: a bad token used to be found by allocate_slots after it took blocks."""
    from kvtier import KVCacheManager

    manager = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64)
    free = manager.block_pool.get_num_free_blocks()
    with pytest.raises(ValueError, match=r"request 'r': prompt_token_ids.*" + bad):
        Request("r", tokens)
    assert manager.block_pool.get_num_free_blocks() == free
    request = Request("r", [1, 2, 3])
    with pytest.raises(ValueError, match=r"output token ids: token 1 is -2147483649; token ids"):
        request.append_output_token_ids([4, -(2**31) - 1])
    with pytest.raises(ValueError, match=r"token 0 is np.int64\(4294967296\)"):
        request.append_output_token_ids(np.int64(2**32))
    assert request.num_tokens == 3 and list(request.all_token_ids) == [1, 2, 3]


def test_numpy_token_ids_are_taken() -> None:
    request = Request("r", np.arange(5, dtype=np.uint32), block_size=2)
    request.append_output_token_ids([np.int64(7)])
    assert list(request.all_token_ids) == [0, 1, 2, 3, 4, 7]
    assert list(request.block_hashes) == hash_request_blocks([0, 1, 2, 3, 4, 7], 2)


def test_placeholder_token_ids_are_taken_as_vllm_takes_them() -> None:
    """vLLM's prefix-caching tests give multimodal inputs the placeholder token -1: its
    manager takes them and hashes them like any token, and so does kvtier's."""
    from kvtier import KVCacheManager

    tokens = [-1] * 20 + list(range(12))
    request = Request("r", tokens, mm_inputs=[("img", 0, 20)])
    assert request.get_block_hashes(16, "sha256_cbor") == hash_request_blocks(
        tokens, 16, mm_inputs=[("img", 0, 20)]
    )
    manager = KVCacheManager(block_size=16, num_gpu_blocks=8, max_model_len=64)
    assert manager.allocate_slots(request, len(tokens)) is not None
