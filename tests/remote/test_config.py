"""URL configuration and the public surface (no server needed)."""

from __future__ import annotations

import pytest

import kvtier.remote
from kvtier.remote.config import RemoteConfig, client_kwargs


def test_public_surface_is_exactly_all() -> None:
    public = {n for n in dir(kvtier.remote) if not n.startswith("_") and n[0].isupper()}
    assert public == set(kvtier.remote.__all__)


def test_tls_url_with_password_and_user() -> None:
    config = RemoteConfig(url="rediss://app:p%40ss@cache.internal:6380/2", ssl_ca_certs="/ca.pem")
    kwargs = client_kwargs(config)
    assert kwargs["ssl"] is True and kwargs["ssl_ca_certs"] == "/ca.pem"
    assert (kwargs["username"], kwargs["password"]) == ("app", "p@ss")
    assert config.redacted_url() == "rediss://app:***@cache.internal:6380/2"
    assert not config.is_cluster


def test_explicit_password_overrides_the_url() -> None:
    assert client_kwargs(RemoteConfig(url="redis://:a@h:1", password="b"))["password"] == "b"


def test_cluster_by_node_list_in_the_url_or_the_config() -> None:
    config = RemoteConfig(url="redis://:pw@10.0.0.1:7000,10.0.0.2:7001")
    assert config.is_cluster and config.all_cluster_nodes() == ("10.0.0.1:7000", "10.0.0.2:7001")
    assert RemoteConfig(cluster_nodes=("a:1",)).is_cluster


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"url": "http://h:1"}, "scheme must be one of"),
        ({"socket_timeout_s": 0}, "every call has a timeout"),
        ({"ttl_s": 0}, "ttl_s must be None or >= 1"),
        ({"key_prefix": "a{b"}, "key_prefix"),
        ({"cluster_nodes": ("nohost",)}, "host:port"),
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RemoteConfig(**kwargs)  # type: ignore[arg-type]
