"""URL configuration and the public surface (no server needed)."""

from __future__ import annotations

import pytest

import kvtier.remote
from kvtier.remote.remote_config import RemoteConfig, client_kwargs


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


SECRET = "s3cr3t-Pw"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        (
            f"redis://:{SECRET}@h:1/abc",
            r"database in the URL path must be an integer >= 0, got 'abc'",
        ),
        (f"redis://:{SECRET}@h:1/-1", "got '-1'"),
        (
            f"redis://:{SECRET}@h:1/0?socket_timeout=abc",
            r"option socket_timeout='abc' in the query",
        ),
        (f"redis://:{SECRET}@h:1/0?socket_timeout=nan", "must be a number of seconds > 0"),
        (f"redis://:{SECRET}@h:1/0?socket_timeout=0", "must be a number of seconds > 0"),
        (
            f"redis://:{SECRET}@h:1/0?timeout=1",
            r"unknown option 'timeout' .* known: socket_timeout",
        ),
        (f"redis://:{SECRET}@a:1,b:2/3", "a Redis Cluster has only database 0, got /3"),
        (f"http://:{SECRET}@h:1/0", "scheme must be one of"),
    ],
)
def test_url_errors_name_the_part_and_never_the_password(url: str, match: str) -> None:
    """Issue 15 item 6: these were printed with the password, or silently ignored."""
    with pytest.raises(ValueError, match=match) as refused:
        RemoteConfig(url=url)
    assert SECRET not in str(refused.value) and ":***@" in str(refused.value)


def test_query_options_set_the_timeouts_and_repr_hides_the_password() -> None:
    config = RemoteConfig(
        url=f"redis://app:{SECRET}@h:1/2?socket_timeout=1.5&socket_connect_timeout=0.5",
        password=SECRET,
    )
    assert (config.socket_timeout_s, config.connect_timeout_s, config.db) == (1.5, 0.5, 2)
    kwargs = client_kwargs(config)
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (1.5, 0.5)
    assert SECRET not in repr(config) and SECRET not in str(config)
    assert "redis://app:***@h:1/2" in repr(config)
    assert RemoteConfig(url="redis://app@h:1/0").redacted_url() == "redis://app@h:1/0"
