"""Checks of caller-given numbers, shared by every layer so a mistake reads the same
wherever it is made (a constructor argument, a CLI flag, an engine's extra config)."""

from __future__ import annotations

import math


def positive_int(name: str, value: object, minimum: int = 1) -> int:
    """`value` itself when it is an int (not a bool) >= minimum; else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def whole_number(name: str, value: object, minimum: int) -> int:
    """`positive_int`, also taking a float with no fraction (JSON writes 8e9 so)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return positive_int(name, value, minimum)


def seconds(name: str, value: object) -> float:
    """`value` itself when it is a finite number (not a bool) >= 0; else a ValueError
    naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ValueError(f"{name}={value!r}; a finite number of seconds >= 0")
    return value


def key_values(text: str, allowed: dict[str, str], where: str = "") -> dict[str, str]:
    """`"a=1, b=2"` as {key: value text}, for settings given as one string (a flag, an
    environment variable). `allowed`: each key and what its value is (for the error);
    an item that is not KEY=VALUE with a key of `allowed` is refused, naming it and what
    is allowed (`where`, if given, says which setting it came from)."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in allowed:
            forms = ", ".join(f"{k}={v}" for k, v in allowed.items())
            raise ValueError(f"{where}{item!r}; allowed: {forms}")
        out[key] = value.strip()
    return out
