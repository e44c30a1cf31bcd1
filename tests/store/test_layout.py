"""KV layout: sizes per block, segment cut, and a fingerprint that is stable and discriminating."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.store.layout import FORMAT_VERSION, KVLayout, LayoutMismatchError

BASE = KVLayout(num_layers=4, num_kv_heads=2, head_size=8, block_size=16, dtype="bfloat16")


def test_bytes_per_block_and_segments() -> None:
    plane = 16 * 2 * 8 * 2
    assert BASE.bytes_per_block == 2 * 4 * plane
    assert (BASE.num_segments, BASE.segment_bytes) == (8, plane)
    cross = dataclasses.replace(BASE, per_layer=False)
    assert cross.bytes_per_block == BASE.bytes_per_block
    assert (cross.num_segments, cross.segment_bytes) == (1, BASE.bytes_per_block)


def test_fingerprint_is_a_fixed_value() -> None:
    # Golden: a change here means every existing disk cache becomes unreadable.
    assert BASE.fingerprint == "f8fcf66ac2e07bae60525ccd84e1462e"
    assert KVLayout(4, 2, 8, 16, "bfloat16").fingerprint == BASE.fingerprint
    assert len(BASE.fingerprint) == 32 and len(BASE.fingerprint_bytes) == 16
    assert BASE.describe()["format_version"] == FORMAT_VERSION


@pytest.mark.parametrize(
    "change",
    [
        {"num_layers": 5},
        {"num_kv_heads": 4},
        {"head_size": 16},
        {"block_size": 32},
        {"dtype": "float16"},
        {"per_layer": False},
        {"model_id": "llama"},
        {"hash_scheme": "xxh3_128"},
        {"format_version": FORMAT_VERSION + 1},
    ],
)
def test_every_field_changes_the_fingerprint(change: dict[str, object]) -> None:
    other = dataclasses.replace(BASE, **change)  # type: ignore[arg-type]
    assert other.fingerprint != BASE.fingerprint
    with pytest.raises(LayoutMismatchError, match="refusing to mix"):
        BASE.check_compatible(other.fingerprint, "somewhere")
    BASE.check_compatible(BASE.fingerprint, "somewhere")


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", 0), ("head_size", -1), ("dtype", "int4"), ("block_size", 1.5)],
)
def test_invalid_layouts_are_rejected(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field if field != "dtype" else "dtype"):
        dataclasses.replace(BASE, **{field: value})  # type: ignore[arg-type]
