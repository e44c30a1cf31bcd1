"""Where the remote tier connects, and how it fails fast.

One URL configures it the way operators already write Redis addresses:
`redis://[:password@]host:port/db`, `rediss://` for TLS, and a cluster as a
comma-separated node list (`redis://:pw@10.0.0.1:7000,10.0.0.2:7000`) or as
`cluster_nodes`. redis-py's own retries are switched off: a failed call is a
miss now, and the circuit breaker (not a retry loop inside the scheduler's
call) decides when to try the server again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvtier.remote.breaker import BreakerConfig

_SCHEMES = ("redis", "rediss")
RedisClient = redis.Redis | RedisCluster


@dataclass(frozen=True)
class RemoteConfig:
    url: str = "redis://127.0.0.1:6379/0"
    # "host:port" entries; non-empty means Redis Cluster (the URL then gives only
    # the scheme and credentials).
    cluster_nodes: tuple[str, ...] = ()
    password: str | None = None  # overrides the URL's password when set
    username: str | None = None
    socket_timeout_s: float = 0.25
    connect_timeout_s: float = 0.25
    max_connections: int = 64
    ttl_s: int | None = None  # optional expiry on top of Redis's maxmemory eviction
    key_prefix: str = "kvt"
    ssl_ca_certs: str | None = None
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in _SCHEMES:
            raise ValueError(f"remote tier URL scheme must be one of {_SCHEMES}, got {self.url!r}")
        for name in ("socket_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (every call has a timeout)")
        if self.ttl_s is not None and self.ttl_s < 1:
            raise ValueError(f"ttl_s must be None or >= 1, got {self.ttl_s}")
        if not self.key_prefix or any(c in self.key_prefix for c in "{}: "):
            raise ValueError(
                f"key_prefix must be non-empty without '{{}}: ', got {self.key_prefix!r}"
            )
        for node in self.all_cluster_nodes():
            _parse_node(node)

    @property
    def is_cluster(self) -> bool:
        return bool(self.all_cluster_nodes())

    def all_cluster_nodes(self) -> tuple[str, ...]:
        """Nodes from `cluster_nodes` and from a comma-separated URL host list."""
        netloc = urlsplit(self.url).netloc.rpartition("@")[2]
        from_url = tuple(netloc.split(",")) if "," in netloc else ()
        return self.cluster_nodes + from_url

    def redacted_url(self) -> str:
        """The URL without its password, for error messages and logs."""
        parts = urlsplit(self.url)
        host = parts.netloc.rpartition("@")[2]
        user = f"{parts.username}:***@" if parts.password else ""
        return parts._replace(netloc=user + host).geturl()


def _parse_node(node: str) -> tuple[str, int]:
    host, sep, port = node.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"cluster node must be 'host:port', got {node!r}")
    return host.strip("[]"), int(port)


def client_kwargs(config: RemoteConfig) -> dict[str, Any]:
    """Options shared by the single-node and cluster clients."""
    parts = urlsplit(config.url)
    kwargs: dict[str, Any] = {
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "max_connections": config.max_connections,
        "password": config.password
        if config.password is not None
        else (unquote(parts.password) if parts.password else None),
        "username": config.username
        if config.username is not None
        else (unquote(parts.username) if parts.username else None),
    }
    if parts.scheme == "rediss":
        kwargs["ssl"] = True
        if config.ssl_ca_certs:
            kwargs["ssl_ca_certs"] = config.ssl_ca_certs
    return kwargs


def make_client(config: RemoteConfig) -> RedisClient:
    """A redis-py client; the cluster client contacts its nodes here (may raise)."""
    kwargs = client_kwargs(config)
    if config.is_cluster:
        nodes = [
            ClusterNode(*_parse_node(n))  # type: ignore[no-untyped-call]
            for n in config.all_cluster_nodes()
        ]
        return RedisCluster(startup_nodes=nodes, **kwargs)
    parts = urlsplit(config.url)
    db = parts.path.strip("/") or "0"
    if not db.isdigit():
        raise ValueError(f"database in the URL path must be an integer, got {config.url!r}")
    return redis.Redis(
        host=parts.hostname or "127.0.0.1", port=parts.port or 6379, db=int(db), **kwargs
    )
