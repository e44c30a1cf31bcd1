"""Block hashes against the docs/semantics.md formula, computed here independently with cbor2."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.hashing import (
    NONE_HASH,
    BlockHashSpec,
    MultiModalInput,
    hash_block_tokens,
    hash_blocks,
    hash_request_blocks,
    none_hash,
)

ExtraFn = Callable[[int], Any]


def ref_h(obj: Any, algorithm: str = "sha256_cbor") -> bytes:
    data = cbor2.dumps(obj, canonical=True)
    if algorithm == "sha256_cbor":
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


def ref_chain(
    tokens: Sequence[int],
    block_size: int,
    extra: ExtraFn = lambda i: None,
    algorithm: str = "sha256_cbor",
    seed: str | None = None,
) -> list[bytes]:
    """hash_i = H([hash_{i-1} or NONE_HASH, tuple(tokens of block i), extra_keys_i])."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    parent = ref_h(seed, algorithm)
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = ref_h([parent, block, extra(i)], algorithm)
        out.append(parent)
    return out


TOKENS = [(i * 7919) % 50_000 for i in range(100)]


def test_tokens_only() -> None:
    assert hash_request_blocks(TOKENS, 16) == ref_chain(TOKENS, 16)
    assert len(hash_request_blocks(TOKENS, 16)) == 6  # the partial tail gets no hash


@pytest.mark.skipif("PYTHONHASHSEED" in os.environ, reason="golden assumes the default seed")
def test_golden_vector_is_stable() -> None:
    # Pinned once from the formula; guards against drift in cbor2 or in our encoder.
    assert (
        hash_request_blocks(list(range(32)), 16)[1].hex()
        == "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c"
    )
    assert (
        hash_request_blocks(list(range(32)), 16, algorithm="xxh3_128")[1].hex()
        == "74ee692fcce0684e02de354d6ca364b4"
    )


def test_cache_salt_only_in_first_block_but_changes_every_hash() -> None:
    salted = hash_request_blocks(TOKENS, 16, cache_salt="tenant-a")
    expected = ref_chain(TOKENS, 16, lambda i: (("cache_salt", "tenant-a"),) if i == 0 else None)
    assert salted == expected
    plain = hash_request_blocks(TOKENS, 16)
    assert all(a != b for a, b in zip(salted, plain, strict=True))
    other = hash_request_blocks(TOKENS, 16, cache_salt="tenant-b")
    assert not set(salted) & set(other)


def test_lora_in_every_block() -> None:
    got = hash_request_blocks(TOKENS, 16, lora_name="sql", lora_path="/adapters/sql")
    assert got == ref_chain(TOKENS, 16, lambda i: (("lora", "sql", "/adapters/sql"),))
    no_path = hash_request_blocks(TOKENS, 16, lora_name="sql")
    assert no_path == ref_chain(TOKENS, 16, lambda i: (("lora", "sql", None),))


def test_multimodal_offsets_relative_to_block_start() -> None:
    # image A covers tokens 10..29 (blocks 0 and 1), image B 40..43 (block 2), C 44..47.
    mm = [("imgA", 10, 20), ("imgB", 40, 4), ("imgC", 44, 4)]
    expected_extra = {
        0: (("mm", "imgA", 10),),
        1: (("mm", "imgA", -6),),
        2: (("mm", "imgB", 8), ("mm", "imgC", 12)),
    }
    got = hash_request_blocks(TOKENS, 16, mm_inputs=mm)
    assert got == ref_chain(TOKENS, 16, lambda i: expected_extra.get(i))


def test_all_extra_keys_in_order() -> None:
    mm = [("img", 3, 2)]
    got = hash_request_blocks(
        TOKENS, 16, cache_salt="s", lora_name="l", lora_path="p", mm_inputs=mm
    )

    def extra(i: int) -> Any:
        keys: list[Any] = [("lora", "l", "p")]
        if i == 0:
            keys += [("mm", "img", 3), ("cache_salt", "s")]
        return tuple(keys)

    assert got == ref_chain(TOKENS, 16, extra)


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_pythonhashseed_sets_the_root(seed: str) -> None:
    code = (
        "from kvtier.hashing import NONE_HASH, hash_request_blocks;"
        "print(NONE_HASH.hex(), hash_request_blocks(list(range(8)), 4)[1].hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == ref_h(seed).hex()
    assert out[1] == ref_chain(list(range(8)), 4, seed=seed)[1].hex()
    env.pop("PYTHONHASHSEED")
    default = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert default[0] == ref_h("vllm-none-hash").hex() != out[0]


def test_none_hash_matches_environment_of_this_process() -> None:
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    assert NONE_HASH == none_hash("sha256_cbor") == ref_h(seed)
    assert none_hash("xxh3_128") == ref_h(seed, "xxh3_128")


def test_xxh3_over_the_same_cbor() -> None:
    got = hash_request_blocks(TOKENS, 16, algorithm="xxh3_128", cache_salt="s")
    extra: ExtraFn = lambda i: (("cache_salt", "s"),) if i == 0 else None  # noqa: E731
    assert got == ref_chain(TOKENS, 16, extra, algorithm="xxh3_128")
    assert all(len(h) == 16 for h in got)


EDGE_VALUES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]


@pytest.mark.parametrize("block_size", [1, 16, 23, 24, 255, 256])
def test_fast_encoder_matches_cbor2_at_every_width(block_size: int) -> None:
    tokens = (EDGE_VALUES * 300)[: block_size * 10 + 1]  # >= 8 blocks: the batched path
    assert hash_request_blocks(tokens, block_size) == ref_chain(tokens, block_size)
    as_array = np.array(tokens, dtype=np.uint32)
    assert hash_request_blocks(as_array, block_size) == ref_chain(tokens, block_size)


@pytest.mark.parametrize("odd", [2**32, 2**63 - 1, 2**64 - 1, 2**70, -1, -(2**40)])
def test_tokens_beyond_the_fast_path_fall_back_to_cbor2(odd: int) -> None:
    tokens = [5, odd, 7, 300] * 5
    assert hash_request_blocks(tokens, 2) == ref_chain(tokens, 2)
    if odd < 2**63:
        as_array = np.array(tokens, dtype=np.int64)
        assert hash_request_blocks(as_array, 2) == ref_chain(tokens, 2)


def test_hash_block_tokens_reference() -> None:
    first = hash_block_tokens(None, TOKENS[:16])
    assert first == ref_chain(TOKENS, 16)[0]
    assert hash_block_tokens(first, TOKENS[16:32]) == ref_chain(TOKENS, 16)[1]


def test_incremental_equals_whole() -> None:
    spec = BlockHashSpec(block_size=16, mm_inputs=(MultiModalInput("i", 20, 30),))
    whole = hash_blocks(spec, TOKENS, None, 0)
    head = hash_blocks(spec, TOKENS[:32], None, 0)
    tail = hash_blocks(spec, TOKENS[32:], head[-1], 2)
    assert head + tail == whole


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size"),
        ({"algorithm": "md5"}, "unknown hash algorithm"),
        ({"lora_path": "/x"}, "without a lora_name"),
        ({"mm_inputs": [("a", 10, 5), ("b", 12, 1)]}, "position order"),
        ({"mm_inputs": [("a", 3, 0)]}, "length >= 1"),
    ],
)
def test_bad_input(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"block_size": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        hash_request_blocks(TOKENS, **args)


@pytest.mark.parametrize(
    "tokens", [[1.5, 2.0], np.array([1.0, 2.0]), ["a", "b"], [1.5] * 20, np.ones(20)]
)
def test_non_integer_tokens_rejected(tokens: Any) -> None:
    with pytest.raises(ValueError, match="int"):
        hash_request_blocks(tokens, 1)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**33), max_size=70),
    block_size=st.integers(1, 9),
    salt=st.none() | st.text(max_size=3),
    lora=st.none() | st.text(min_size=1, max_size=3),
    mm_start=st.integers(0, 40),
    mm_len=st.integers(1, 12),
    algorithm=st.sampled_from(["sha256_cbor", "xxh3_128"]),
)
def test_matches_formula_on_random_input(
    tokens: list[int],
    block_size: int,
    salt: str | None,
    lora: str | None,
    mm_start: int,
    mm_len: int,
    algorithm: Any,
) -> None:
    mm = [("m", mm_start, mm_len)]

    def extra(i: int) -> Any:
        start, end = i * block_size, (i + 1) * block_size
        keys: list[Any] = []
        if lora is not None:
            keys.append(("lora", lora, None))
        if mm_start < end and mm_start + mm_len > start:
            keys.append(("mm", "m", mm_start - start))
        if i == 0 and salt:
            keys.append(("cache_salt", salt))
        return tuple(keys) or None

    got = hash_request_blocks(
        tokens, block_size, cache_salt=salt, lora_name=lora, mm_inputs=mm, algorithm=algorithm
    )
    assert got == ref_chain(tokens, block_size, extra, algorithm)
