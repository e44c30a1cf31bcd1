"""What the router is given: its engines, how to reach their events, how to route."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.router.scoring import POLICIES, Weights
from kvtier.validate import positive_int, seconds

# Every answer the router passes on says which engine gave it (a client's load run
# records it; here, not in the proxy, so reading it needs none of the router's extras).
ENGINE_HEADER = "X-Kvtier-Engine"


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM OpenAI server.

    `events`: its `--kv-events-config` publisher endpoint. The router connects to it
    when the engine binds (an endpoint with `*`, or `ipc://`), and binds it itself
    with `bind_events=True` (the engine's publisher then connects, as vLLM does for a
    `tcp://host:port` endpoint). `replay`: the publisher's `replay_endpoint`, from
    which missed batches are asked for again. `topic`: the publisher's topic.
    """

    url: str
    events: str | None = None
    replay: str | None = None
    topic: str = ""
    bind_events: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://, got {self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if not self.name:
            object.__setattr__(self, "name", self.url.split("://", 1)[1])
        for what, endpoint in (("events", self.events), ("replay", self.replay)):
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{what} endpoint must be tcp:// or ipc://, got {endpoint!r}")
        if self.replay is not None and self.events is None:
            raise ValueError(f"engine {self.url}: a replay endpoint needs an events endpoint")


@dataclass(frozen=True)
class RouterConfig:
    engines: tuple[EngineSpec, ...]
    block_size: int = 16
    model_dir: str | None = None
    hash_seed: str | None = None
    policy: str = "kv"
    weights: Weights = field(default_factory=Weights)
    # an engine that has not answered the first byte in this long is taken out
    request_timeout_s: float = 120.0
    connect_timeout_s: float = 2.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    replay_timeout_s: float = 2.0
    # a prompt just routed counts as in its engine's pool until the engine's events name
    # its blocks, for at most this long (kvtier.router.index; 0: wait for the events)
    routed_ttl_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("the router needs at least one engine")
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        positive_int("block_size", self.block_size)
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; known: {POLICIES}")
        for name in (
            "request_timeout_s",
            "connect_timeout_s",
            "health_interval_s",
            "health_timeout_s",
            "replay_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        seconds("routed_ttl_s", self.routed_ttl_s)
