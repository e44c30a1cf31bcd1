"""Trace readers.

Every reader yields `TraceRequest`s in file order and names the file, the line and
the field on malformed input: a replay that silently skips lines reports hit rates
for a workload nobody ran.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TraceFormatError(ValueError):
    """A trace line that cannot be read; the message names file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


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
    return value


def _json_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with path.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{where}: expected a JSON object, got {obj!r}")
            yield where, obj


def read_mooncake(path: str | Path) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace (`timestamp`, `input_length`, `output_length`, `hash_ids`)."""
    requests: list[TraceRequest] = []
    for where, obj in _json_lines(Path(path)):
        hash_ids = _field(obj, "hash_ids", list, where)
        for value in hash_ids:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TraceFormatError(
                    f"{where}: field 'hash_ids' must hold integers >= 0, got {value!r}"
                )
        input_length = _field(obj, "input_length", int, where)
        output_length = _field(obj, "output_length", int, where)
        if input_length < 0 or output_length < 0:
            raise TraceFormatError(
                f"{where}: lengths must be >= 0, got {input_length}, {output_length}"
            )
        requests.append(
            TraceRequest(
                timestamp=float(_field(obj, "timestamp", float, where)),
                input_length=input_length,
                output_length=output_length,
                hash_ids=tuple(hash_ids),
            )
        )
    return requests
