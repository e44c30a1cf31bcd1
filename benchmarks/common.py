"""Helpers shared by the benchmarks: where results go and where the real trace lives."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
CONVERSATION_TRACE = REPO_ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write one benchmark's JSON (with the machine it ran on) and return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    document = {"benchmark": name, "machine": platform.platform(), **payload}
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    return path
