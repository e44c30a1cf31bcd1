"""What the router counts: its own tallies and each engine's state.

Apart from the proxy so that its `/metrics` (`kvtier.router.metrics`) reads them
without importing the proxy that serves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.router.config import EngineSpec

if TYPE_CHECKING:
    from kvtier.router.subscriber import EventSubscriber


@dataclass
class EngineState:
    spec: EngineSpec
    up: bool = True
    in_flight: int = 0
    requests: int = 0  # answered through the router
    failures: int = 0  # requests it failed (then sent elsewhere)
    taken_out: int = 0
    subscriber: EventSubscriber | None = None

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class RouterCounters:
    requests: int = 0
    retries: int = 0
    unanswered: int = 0  # no engine could answer
    prompt_errors: int = 0  # routed cold: the prompt could not be tokenized
    by_reason: dict[str, int] = field(default_factory=dict)
