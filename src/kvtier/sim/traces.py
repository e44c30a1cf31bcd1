"""Trace readers.

Every reader yields `TraceRequest`s in file order and names the file, the line and
the field on malformed input: a replay that silently skips lines reports hit rates
for a workload nobody ran.

All readers return integer block ids, so the replay loop never cares where the ids
came from. Timestamps are milliseconds since the trace start in every format
(Bailian's seconds are converted), so the concurrency model has one unit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvtier.types import MAX_INT_BLOCK_HASH


class TraceFormatError(ValueError):
    """A trace line that cannot be read; the message names file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    # Bailian's conversation structure; None for formats that do not carry it.
    chat_id: int | None = None
    parent_chat_id: int | None = None
    turn: int | None = None
    kind: str | None = None


def _field(obj: dict[str, Any], name: str, kind: type, where: str) -> Any:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    value = obj[name]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise TraceFormatError(f"{where}: field {name!r} must be an integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise TraceFormatError(f"{where}: field {name!r} must be a number, got {value!r}")
    if kind is list and not isinstance(value, list):
        raise TraceFormatError(f"{where}: field {name!r} must be a list, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise TraceFormatError(f"{where}: field {name!r} must be a string, got {value!r}")
    return value


def _json_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        f = path.open("rb")
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot open trace ({e.strerror})") from None
    with f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceFormatError(
                    f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "a trace is UTF-8 JSON lines"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{where}: expected a JSON object, got {obj!r}")
            yield where, obj


def _int_list(obj: dict[str, Any], name: str, where: str, limit: int) -> list[int]:
    """The field as a list of integers in [0, limit]."""
    values: list[int] = _field(obj, name, list, where)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
            raise TraceFormatError(
                f"{where}: field {name!r} must hold integers in [0, {limit}], got {value!r}"
            )
    return values


def _hash_ids(obj: dict[str, Any], where: str, input_length: int, block_size: int) -> list[int]:
    """The request's block ids: at most one per `block_size` tokens of its input (a
    block id beyond the input would count hits on tokens nobody sent)."""
    ids = _int_list(obj, "hash_ids", where, MAX_INT_BLOCK_HASH)
    most = -(-input_length // block_size)
    if len(ids) > most:
        raise TraceFormatError(
            f"{where}: {len(ids)} hash_ids but input_length {input_length} fills at most "
            f"{most} blocks of {block_size} tokens"
        )
    return ids


def _lengths(obj: dict[str, Any], where: str) -> tuple[int, int]:
    input_length = _field(obj, "input_length", int, where)
    output_length = _field(obj, "output_length", int, where)
    if input_length < 0 or output_length < 0:
        raise TraceFormatError(
            f"{where}: lengths must be >= 0, got {input_length}, {output_length}"
        )
    return input_length, output_length


def _timestamp(obj: dict[str, Any], where: str, scale: float = 1.0) -> float:
    value = float(_field(obj, "timestamp", float, where)) * scale
    if not 0 <= value < math.inf:  # NaN fails too: it would scramble the replay order
        raise TraceFormatError(
            f"{where}: field 'timestamp' must be a finite number >= 0, got {obj['timestamp']!r}"
        )
    return value


def read_mooncake(path: str | Path, block_size: int = 512) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace (`timestamp`, `input_length`, `output_length`, `hash_ids`)."""
    requests: list[TraceRequest] = []
    for where, obj in _json_lines(Path(path)):
        input_length, output_length = _lengths(obj, where)
        hash_ids = _hash_ids(obj, where, input_length, block_size)
        requests.append(
            TraceRequest(
                timestamp=_timestamp(obj, where),
                input_length=input_length,
                output_length=output_length,
                hash_ids=tuple(hash_ids),
            )
        )
    return requests


def read_bailian(path: str | Path, block_size: int = 16) -> list[TraceRequest]:
    """Read an Alibaba Bailian JSONL trace (16-token blocks, timestamps in seconds).

    Its hash ids are not chained (an id names a block's content, not its prefix), so
    the replay reports any-position and prefix-consecutive hits separately for it.
    `parent_chat_id` -1 (or null) means "first turn".
    """
    requests: list[TraceRequest] = []
    for where, obj in _json_lines(Path(path)):
        input_length, output_length = _lengths(obj, where)
        hash_ids = _hash_ids(obj, where, input_length, block_size)
        parent = obj.get("parent_chat_id", -1)
        if parent is None:
            parent = -1
        if isinstance(parent, bool) or not isinstance(parent, int):
            raise TraceFormatError(
                f"{where}: field 'parent_chat_id' must be an integer, got {parent!r}"
            )
        requests.append(
            TraceRequest(
                timestamp=_timestamp(obj, where, scale=1000.0),
                input_length=input_length,
                output_length=output_length,
                hash_ids=tuple(hash_ids),
                chat_id=_field(obj, "chat_id", int, where),
                parent_chat_id=None if parent < 0 else parent,
                turn=_field(obj, "turn", int, where),
                kind=_field(obj, "type", str, where),
            )
        )
    return requests


def read_tokens(
    path: str | Path, block_size: int = 16, algorithm: str = "sha256_cbor"
) -> list[TraceRequest]:
    """Read JSONL with token ids and hash them with kvtier's own chained hashing.

    Line fields: `token_ids` (list of ints), `output_length`, optional `timestamp`
    (ms, default: the line number, so requests keep file order), optional
    `cache_salt` and `lora_name`. Only full blocks get a hash, as in the engine.
    The hashes are interned to dense integers so the replay treats every format alike.
    """
    from kvtier.hashing import (
        MAX_TOKEN_ID,
        HashAlgorithm,
        digest_function,
        hash_request_blocks,
    )
    from kvtier.validate import positive_int

    # Checked before the first line, so that a bad call fails on an empty trace too.
    digest_function(cast("HashAlgorithm", algorithm))
    positive_int("block_size", block_size)
    interned: dict[bytes, int] = {}
    requests: list[TraceRequest] = []
    for index, (where, obj) in enumerate(_json_lines(Path(path))):
        token_ids = _int_list(obj, "token_ids", where, MAX_TOKEN_ID)
        output_length = _field(obj, "output_length", int, where)
        if output_length < 0:
            raise TraceFormatError(f"{where}: field 'output_length' must be >= 0")
        salt = obj.get("cache_salt")
        lora = obj.get("lora_name")
        for name, value in (("cache_salt", salt), ("lora_name", lora)):
            if value is not None and not isinstance(value, str):
                raise TraceFormatError(f"{where}: field {name!r} must be a string, got {value!r}")
        ts = _timestamp(obj, where) if "timestamp" in obj else float(index)
        hashes = hash_request_blocks(
            token_ids,
            block_size,
            cache_salt=salt,
            lora_name=lora,
            algorithm=cast("HashAlgorithm", algorithm),  # checked above
        )
        ids = tuple(interned.setdefault(bytes(h), len(interned)) for h in hashes)
        requests.append(TraceRequest(ts, len(token_ids), output_length, ids))
    return requests
