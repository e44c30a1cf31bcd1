"""Checks of caller-given numbers, shared by every layer so a mistake reads the same
wherever it is made (a constructor argument, a CLI flag, an engine's extra config)."""

from __future__ import annotations


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
