"""kvtier's log lines where vLLM's go, at vLLM's level.

vLLM configures its own logger ("vllm": its handler, format and `VLLM_LOGGING_LEVEL`)
and leaves the root logger alone, so a plug-in's logger gets only Python's last-resort
handler: warnings, bare, and no INFO line at all (a flush of the CPU tier at shutdown,
the load-or-recompute decisions an engine made). Following vLLM's logger puts kvtier's
lines in the engine's log with vLLM's prefix (process, time), at the level its operator
chose. A kvtier logger someone configured already is left as it is.
"""

from __future__ import annotations

import logging


def follow_vllm_logging() -> None:
    """Give the "kvtier" logger vLLM's handlers and level, once, where nobody set its own
    (it still propagates: a handler on the root logger, pytest's, sees its records too)."""
    ours = logging.getLogger("kvtier")
    if ours.handlers or ours.level != logging.NOTSET:
        return
    theirs = logging.getLogger("vllm")
    if not theirs.handlers:
        return
    ours.setLevel(theirs.getEffectiveLevel())
    for handler in theirs.handlers:
        ours.addHandler(handler)
