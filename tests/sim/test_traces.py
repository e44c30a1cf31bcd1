"""Trace readers: every format, and errors that name file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.sim.traces import TraceFormatError, read_bailian, read_mooncake
from kvtier.sim.workload import load_workload
from kvtier.types import int_block_hash


def _write(tmp_path: Path, name: str, rows: list[object]) -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


BAILIAN_ROW = {
    "chat_id": 7,
    "parent_chat_id": -1,
    "timestamp": 1.5,
    "input_length": 40,
    "output_length": 9,
    "type": "text",
    "turn": 1,
    "hash_ids": [3, 4, 3],
}


def test_bailian_fields_and_units(tmp_path: Path) -> None:
    child = {**BAILIAN_ROW, "chat_id": 8, "parent_chat_id": 7, "turn": 2, "timestamp": 2}
    (first, second) = read_bailian(_write(tmp_path, "b.jsonl", [BAILIAN_ROW, child]))
    assert first.timestamp == 1500.0  # seconds -> ms, like Mooncake
    assert first.parent_chat_id is None and second.parent_chat_id == 7
    assert (second.chat_id, second.turn, second.kind) == (8, 2, "text")
    assert first.hash_ids == (3, 4, 3)


def test_workload_dedupes_ids_within_a_request_and_knows_chaining(tmp_path: Path) -> None:
    path = _write(tmp_path, "b.jsonl", [BAILIAN_ROW])
    workload = load_workload(path, "bailian")
    assert workload.block_ids == ((3, 4),)
    assert workload.chained is False and workload.block_size == 16
    assert workload.block_tokens(0, 0) == 16 and workload.block_tokens(0, 2) == 8


def test_workload_sorts_by_timestamp_stably(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 2, "input_length": 1, "output_length": 1, "hash_ids": [2]},
        {"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [3]},
    ]
    workload = load_workload(_write(tmp_path, "m.jsonl", rows))
    assert workload.block_ids == ((2,), (1,), (3,))
    assert workload.limited(2).block_ids == ((2,), (1,))


def test_workload_packs_an_id_into_one_hash_object_wherever_it_occurs(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]},
        {"timestamp": 2, "input_length": 1024, "output_length": 1, "hash_ids": [7, 9]},
    ]
    first, second = load_workload(_write(tmp_path, "m.jsonl", rows)).block_hashes
    assert first[0] == int_block_hash(7) and second[1] == int_block_hash(9)
    assert first[0] is second[0]  # the tiers' maps then match it by identity


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"timestamp": 0, "input_length": 1, "output_length": 1}, "hash_ids"),
        ({"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": []}, "input_length"),
        ({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [-1]}, "hash_ids"),
        ({"timestamp": -3, "input_length": 1, "output_length": 1, "hash_ids": []}, "timestamp"),
        ({"timestamp": True, "input_length": 1, "output_length": 1, "hash_ids": []}, "timestamp"),
    ],
)
def test_mooncake_errors_name_file_line_and_field(
    tmp_path: Path, row: dict[str, object], field: str
) -> None:
    good = {"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}
    path = _write(tmp_path, "bad.jsonl", [good, row])
    with pytest.raises(TraceFormatError, match=rf"bad\.jsonl:2: .*'{field}'"):
        read_mooncake(path)


def test_bailian_error_names_missing_field(tmp_path: Path) -> None:
    row = {k: v for k, v in BAILIAN_ROW.items() if k != "turn"}
    with pytest.raises(TraceFormatError, match=r"b\.jsonl:1: missing field 'turn'"):
        read_bailian(_write(tmp_path, "b.jsonl", [row]))


def test_invalid_json_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"timestamp": 0}\n{oops\n')
    with pytest.raises(TraceFormatError, match=r"x\.jsonl:1: missing field"):
        read_mooncake(path)
    path.write_text("\n[1, 2]\n")
    with pytest.raises(TraceFormatError, match=r"x\.jsonl:2: expected a JSON object"):
        read_mooncake(path)
    with pytest.raises(TraceFormatError, match="cannot open"):
        read_mooncake(tmp_path / "absent.jsonl")


def test_unknown_format_lists_known(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mooncake, bailian, tokens"):
        load_workload(tmp_path / "x", "csv")


def test_real_trace_shape(conversation_trace_path: Path) -> None:
    workload = load_workload(conversation_trace_path)
    assert len(workload.requests) == 12_031
    assert (workload.block_refs, workload.unique_blocks) == (288_500, 182_790)
    assert workload.chained and workload.block_size == 512


def test_tokens_reader_hashes_full_blocks_and_interns(tmp_path: Path) -> None:
    from kvtier.hashing import hash_request_blocks
    from kvtier.sim.traces import read_tokens

    shared = list(range(32))
    rows = [
        {"token_ids": [*shared, 99], "output_length": 4},
        {"token_ids": [*shared, 7, 8], "output_length": 4, "timestamp": 5},
        {"token_ids": shared, "output_length": 1, "cache_salt": "tenant-b"},
    ]
    a, b, c = read_tokens(_write(tmp_path, "t.jsonl", rows), block_size=16)
    assert a.hash_ids == b.hash_ids == (0, 1)  # same two full blocks; tails get no hash
    assert set(c.hash_ids).isdisjoint(a.hash_ids)  # a salt changes every hash
    assert (a.input_length, b.timestamp) == (33, 5.0)
    assert len(hash_request_blocks([*shared, 99], 16)) == 2


def test_tokens_reader_errors(tmp_path: Path) -> None:
    from kvtier.sim.traces import read_tokens

    path = _write(tmp_path, "t.jsonl", [{"token_ids": [1, "x"], "output_length": 1}])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: field 'token_ids'"):
        read_tokens(path)
    path = _write(tmp_path, "t.jsonl", [{"token_ids": [1], "output_length": 1, "cache_salt": 3}])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: field 'cache_salt'"):
        read_tokens(path)
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        read_tokens(path, algorithm="md5")


ROW = {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"timestamp":0,"input_length":1024,"output_length":1,'
            '"hash_ids":[1180591620717411303424,2]}',
            r"t.jsonl:1: field 'hash_ids' must hold integers in \[0, 18446744073709551615\], "
            "got 1180591620717411303424",
        ),
        (
            '{"timestamp":NaN,"input_length":1024,"output_length":1,"hash_ids":[1]}',
            "t.jsonl:1: field 'timestamp' must be a finite number >= 0, got nan",
        ),
        (
            '{"timestamp":Infinity,"input_length":1024,"output_length":1,"hash_ids":[1]}',
            "t.jsonl:1: field 'timestamp' must be a finite number >= 0, got inf",
        ),
        (
            '{"timestamp":0,"input_length":1,"output_length":1,"hash_ids":[1,2,3,4,5,6,7,8,9,10]}',
            "t.jsonl:1: 10 hash_ids but input_length 1 fills at most 1 blocks of 512 tokens",
        ),
    ],
)
def test_out_of_range_values_name_line_field_and_range(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=message.replace("t.jsonl:1", "t.jsonl:2")):
        load_workload(path)


def test_block_count_bound_is_per_format(tmp_path: Path) -> None:
    """A block may be partial (ceil), but every id needs at least one input token."""
    exact = {**ROW, "input_length": 513}  # 2 blocks of 512: the second holds 1 token
    assert read_mooncake(_write(tmp_path, "m.jsonl", [exact]))[0].hash_ids == (1, 2)
    row = {**BAILIAN_ROW, "input_length": 32}  # 3 ids of 16 tokens need > 32
    with pytest.raises(TraceFormatError, match="3 hash_ids but input_length 32"):
        read_bailian(_write(tmp_path, "b.jsonl", [row]))


def test_invalid_utf8_names_file_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(ROW).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2: not UTF-8 \(byte 0xff at column 1\)"):
        read_mooncake(path)


@pytest.mark.parametrize(
    ("rows", "what"),
    [([], "no requests"), ([{**ROW, "hash_ids": []}], "1 requests but no blocks")],
)
def test_a_trace_without_blocks_is_refused(tmp_path: Path, rows: list[object], what: str) -> None:
    path = _write(tmp_path, "e.jsonl", rows)
    with pytest.raises(TraceFormatError, match=f"e.jsonl: the trace holds {what}"):
        load_workload(path)


def test_token_ids_out_of_range_are_refused(tmp_path: Path) -> None:
    from kvtier.sim.traces import read_tokens

    for bad in (-1, 2**32, 1.5):
        path = _write(tmp_path, "k.jsonl", [{"token_ids": [1, bad], "output_length": 1}])
        with pytest.raises(TraceFormatError, match=r"k.jsonl:1: field 'token_ids' must hold"):
            read_tokens(path)
