"""Where the remote tier connects, and how it fails fast.

One URL configures it the way operators already write Redis addresses:
`redis://[:password@]host:port/db`, `rediss://` for TLS, and a cluster as a
comma-separated node list (`redis://:pw@10.0.0.1:7000,10.0.0.2:7000`) or as
`cluster_nodes`. redis-py's own retries are switched off: a failed call is a
miss now, and the circuit breaker (not a retry loop inside the scheduler's
call) decides when to try the server again.

Everything the URL says is checked here, before any connection: the database
index (an integer, 0 for a cluster), the query options (`socket_timeout`,
`socket_connect_timeout`, in seconds; any other is refused, not ignored). Errors
and reprs never show the password.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AuthenticationError, RedisClusterException
from redis.retry import Retry

from kvtier.remote.breaker import BreakerConfig

_SCHEMES = ("redis", "rediss")
# URL query options -> the RemoteConfig field each one sets (redis-py's names).
_QUERY_OPTIONS = {
    "socket_timeout": "socket_timeout_s",
    "socket_connect_timeout": "connect_timeout_s",
}
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
        parts = urlsplit(self.url)
        where = self.redacted_url()
        if parts.scheme not in _SCHEMES:
            raise ValueError(f"remote tier URL scheme must be one of {_SCHEMES}, got {where!r}")
        for name, value in self._url_options(parts.query, where).items():
            object.__setattr__(self, name, value)
        for name in ("socket_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(
                    f"{name} must be a finite number of seconds > 0 (every call has a "
                    f"timeout), got {value!r}"
                )
        if self.ttl_s is not None and self.ttl_s < 1:
            raise ValueError(f"ttl_s must be None or >= 1, got {self.ttl_s}")
        if not self.key_prefix or any(c in self.key_prefix for c in "{}: "):
            raise ValueError(
                f"key_prefix must be non-empty without '{{}}: ', got {self.key_prefix!r}"
            )
        for node in self.all_cluster_nodes():
            _parse_node(node)
        db = self.db
        if self.is_cluster and db != 0:
            raise ValueError(f"a Redis Cluster has only database 0, got /{db} in {where!r}")

    @staticmethod
    def _url_options(query: str, where: str) -> dict[str, float]:
        """The URL's query options as RemoteConfig fields; unknown or bad ones refused."""
        options: dict[str, float] = {}
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
        except ValueError:
            raise ValueError(f"query of {where!r} is not name=value pairs") from None
        for name, text in pairs:
            if name not in _QUERY_OPTIONS:
                raise ValueError(
                    f"unknown option {name!r} in the query of {where!r}; known: "
                    f"{', '.join(_QUERY_OPTIONS)}"
                )
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not 0 < value < math.inf:
                raise ValueError(
                    f"option {name}={text!r} in the query of {where!r} must be a number of "
                    "seconds > 0"
                )
            options[_QUERY_OPTIONS[name]] = value
        return options

    @property
    def db(self) -> int:
        """The database index in the URL path (0 when there is none)."""
        path = urlsplit(self.url).path.strip("/") or "0"
        if not path.isdigit() or not path.isascii():
            raise ValueError(
                f"database in the URL path must be an integer >= 0, got {path!r} in "
                f"{self.redacted_url()!r}"
            )
        return int(path)

    def __repr__(self) -> str:
        hidden = "***" if self.password is not None else None
        return (
            f"RemoteConfig(url={self.redacted_url()!r}, cluster_nodes={self.cluster_nodes!r}, "
            f"password={hidden!r}, username={self.username!r}, "
            f"socket_timeout_s={self.socket_timeout_s!r}, "
            f"connect_timeout_s={self.connect_timeout_s!r}, ttl_s={self.ttl_s!r}, "
            f"key_prefix={self.key_prefix!r})"
        )

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
        user, at, host = parts.netloc.rpartition("@")
        if at:
            name, colon, _ = user.partition(":")
            user = f"{name}:***@" if colon else f"{name}@"
        return parts._replace(netloc=user + host).geturl()


def _parse_node(node: str) -> tuple[str, int]:
    host, sep, port = node.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"cluster node must be 'host:port', got {node!r}")
    return host.strip("[]"), int(port)


# Bytes per socket read of a reply (redis-py's default: 64 KiB). A load's reply is
# tens of MB, and each read gives the GIL back: in an engine's worker, whose main thread
# polls without pause, the reading thread waited for the GIL after every read, and a
# 50 MB load of a tensor-parallel worker took 1.9 s (a Python thread that spins beside
# it: 68 s at 64 KiB, 7.6 s at 1 MiB, 2.6-4.9 s at 4 MiB; 0.16 s alone).
SOCKET_READ_BYTES = 4 << 20


def client_kwargs(config: RemoteConfig) -> dict[str, Any]:
    """Options shared by the single-node and cluster clients."""
    parts = urlsplit(config.url)
    kwargs: dict[str, Any] = {
        "socket_read_size": SOCKET_READ_BYTES,
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
    """A redis-py client. A cluster's client is built at its first call (see
    `DeferredCluster`): building one contacts the nodes, which may be down."""
    kwargs = client_kwargs(config)
    if config.is_cluster:
        nodes = [
            ClusterNode(*_parse_node(n))  # type: ignore[no-untyped-call]
            for n in config.all_cluster_nodes()
        ]
        deferred = DeferredCluster(lambda: RedisCluster(startup_nodes=nodes, **kwargs))
        return cast(RedisCluster, deferred)
    parts = urlsplit(config.url)
    return redis.Redis(
        host=parts.hostname or "127.0.0.1", port=parts.port or 6379, db=config.db, **kwargs
    )


class NotAClusterError(redis.ResponseError):
    """A node of the list answered, but is not in cluster mode (a configuration error)."""


class DeferredCluster:
    """A `RedisCluster` built at first use, and again at each use until it is built.

    redis-py's cluster client contacts its nodes when it is constructed, so a node list
    whose nodes are all down could not even be configured, while a single node that is
    down degrades (its calls fail, counted, and the breaker retries later). Deferring
    the construction gives both one behaviour: a build that finds no node raises
    `redis.ConnectionError` from the call, like a single node's call; a node that
    answers without cluster mode raises `NotAClusterError` (a start-up error).
    """

    def __init__(self, build: Callable[[], RedisCluster]) -> None:
        self._build = build
        self._client: RedisCluster | None = None

    def client(self) -> RedisCluster:
        if self._client is None:
            try:
                self._client = self._build()
            except RedisClusterException as exc:
                text = str(exc)
                if "Cluster mode is not enabled" in text:
                    raise NotAClusterError(text) from exc
                if "WRONGPASS" in text or "invalid username-password" in text:
                    raise AuthenticationError(text) from exc
                raise redis.ConnectionError(text) from exc
        return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client(), name)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
