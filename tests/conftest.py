"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvtier.sim.traces import TraceRequest, read_mooncake

# Property tests are part of CI: the same examples every run (derandomized, no example
# database carried between runs) and no per-example deadline on a loaded 2-core box.
settings.register_profile(
    "kvtier",
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvtier"))

REPO_ROOT = Path(__file__).resolve().parents[1]
CONVERSATION_TRACE = REPO_ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"

_trace_cache: list[TraceRequest] | None = None


@pytest.fixture(scope="session")
def conversation_trace_path() -> Path:
    """The Mooncake trace read in place from ../shared; CI must have it, dev clones may not."""
    if not CONVERSATION_TRACE.exists():
        if os.environ.get("CI"):
            pytest.fail(f"trace missing in CI: {CONVERSATION_TRACE}")
        pytest.skip(f"trace not found at {CONVERSATION_TRACE}")
    return CONVERSATION_TRACE


@pytest.fixture(scope="session")
def conversation_trace(conversation_trace_path: Path) -> list[TraceRequest]:
    global _trace_cache
    if _trace_cache is None:
        _trace_cache = read_mooncake(conversation_trace_path)
    return _trace_cache
