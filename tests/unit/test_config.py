"""ServiceConfig validation: every bad value is refused, naming its key."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from kvservice import ConfigError, KVLayout, ServiceConfig
from kvservice.discovery.settings import DiscoverySettings

POSITIVE = (
    "bootstrap_timeout_s", "transfer_timeout_s", "arrival_timeout_s", "connect_timeout_s",
    "heartbeat_interval_s", "peer_timeout_s", "poll_interval_s", "idle_poll_interval_s",
    "max_posts_per_tick", "max_checks_per_tick", "results_kept",
    "max_handshakes", "max_handshakes_per_source",
)


def test_defaults_are_valid() -> None:
    cfg = ServiceConfig()
    assert isinstance(cfg.layout, KVLayout)
    assert cfg.replace(port=5000).port == 5000


@pytest.mark.parametrize("key", POSITIVE)
@pytest.mark.parametrize("value", [0, -1, True, "1", None])
def test_positive_numbers(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: must be a positive number, got {value!r}$"):
        ServiceConfig(**{key: value})


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"layout": {"layers": 2}}, "layout"),
        ({"port": -1}, "port"),
        ({"port": 65536}, "port"),
        ({"drain_grace_s": -0.1}, "drain_grace_s"),
        ({"heartbeat_interval_s": 1.0, "peer_timeout_s": 1.0}, "peer_timeout_s"),
        ({"max_frame_bytes": 65535}, "max_frame_bytes"),
        ({"agent_prefix": ""}, "agent_prefix"),
        ({"agent_prefix": "kv service"}, "agent_prefix"),
        ({"agent_prefix": "kv/svc"}, "agent_prefix"),
    ],
)
def test_other_bad_values_name_the_key(changes: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        ServiceConfig(**changes)


def test_boundaries_that_are_allowed() -> None:
    cfg = ServiceConfig(port=65535, drain_grace_s=0, max_frame_bytes=65536, agent_prefix="kv-2")
    assert (cfg.port, cfg.drain_grace_s, cfg.max_frame_bytes) == (65535, 0, 65536)


def test_config_error_is_a_value_error_and_config_is_frozen() -> None:
    assert issubclass(ConfigError, ValueError)
    cfg = ServiceConfig()
    with pytest.raises(AttributeError):
        cfg.port = 1  # type: ignore[misc]


def test_replace_validates() -> None:
    with pytest.raises(ConfigError, match=r"^results_kept: "):
        ServiceConfig().replace(results_kept=0)


def test_discovery_keys_are_discoverys_own_with_its_defaults_and_types() -> None:
    """The file holds discovery's keys flat among the service's: each one ``ServiceConfig``
    declares is ``DiscoverySettings``' key of that name, default and type, and they reach it."""
    ours = {f.name: f.default for f in dataclasses.fields(ServiceConfig)}
    hints, theirs = typing.get_type_hints(ServiceConfig), typing.get_type_hints(DiscoverySettings)
    for f in dataclasses.fields(DiscoverySettings):
        assert (ours[f.name], hints[f.name]) == (f.default, theirs[f.name]), f.name
    cfg = ServiceConfig(**{"discovery": "etcd", "cluster": "c", "etcd_endpoints": ["e:1"]})  # a list, as JSON has
    assert cfg.etcd_endpoints == ("e:1",)
    assert cfg.discovery_settings == DiscoverySettings(discovery="etcd", cluster="c", etcd_endpoints=("e:1",))
    with pytest.raises(ConfigError, match=r"^discovery: must be one of static, etcd, got 'consul'$"):
        DiscoverySettings(discovery="consul")  # type: ignore[arg-type]
