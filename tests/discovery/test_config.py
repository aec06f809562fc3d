"""Discovery options: static is the default and needs nothing; every bad etcd value is a
ConfigError naming its key, from the constructor, the sidecar's TOML and KVSERVICE_*."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvservice import ConfigError, ServiceConfig
from kvservice.discovery.settings import split_endpoint
from kvservice.sidecar.settings import from_mapping, load, to_toml

CONFIG = Path(__file__).resolve().parents[2] / "config"


def test_static_is_the_default() -> None:
    cfg = ServiceConfig()
    assert cfg.discovery == "static"
    assert load(CONFIG / "decode.toml", env={}).service.discovery == "static"


@pytest.mark.parametrize(("changes", "message"), [
    ({"discovery": "consul"}, r"^discovery: must be one of static, etcd, got 'consul'$"),
    ({"cluster": "a/b"}, r"^cluster: letters, digits"),
    ({"cluster": ""}, r"^cluster: "),
    ({"discovery_name": "prefill/3"}, r"^discovery_name: "),
    ({"discovery_role": "de code"}, r"^discovery_role: "),
    ({"etcd_endpoints": ()}, r"^etcd_endpoints: must list at least one"),
    ({"etcd_endpoints": ("etcd",)}, r"^etcd_endpoints: expected host:port"),
    ({"etcd_endpoints": ("etcd:0",)}, r"^etcd_endpoints: expected host:port"),
    ({"etcd_endpoints": ("ftp://etcd:2379",)}, r"^etcd_endpoints: expected host:port"),
    ({"etcd_ttl_s": 2.5}, r"^etcd_ttl_s: etcd leases are whole seconds"),
    ({"etcd_ttl_s": 1}, r"^etcd_ttl_s: etcd leases are whole seconds"),
    ({"etcd_ttl_s": 0}, r"^etcd_ttl_s: must be a positive number"),
    ({"etcd_keepalive_s": 5.0}, r"^etcd_keepalive_s: must be under half of etcd_ttl_s"),
    ({"etcd_rejoin_grace_s": -1}, r"^etcd_rejoin_grace_s: must be a positive number"),
    ({"etcd_connect_timeout_s": True}, r"^etcd_connect_timeout_s: must be a positive number"),
    ({"etcd_unreachable": "maybe"}, r"^etcd_unreachable: must be one of wait, fail, got 'maybe'$"),
    ({"etcd_endpoints": ("https://etcd:2379",)}, r"^etcd_ca_file: required with https://"),
    ({"etcd_ca_file": "/nonexistent/ca.pem"}, r"^etcd_ca_file: no such file"),
    ({"etcd_username": "kv"}, r"^etcd_username, etcd_password_file: etcd authentication needs both$"),
])
def test_bad_values_name_their_key(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServiceConfig(**{"discovery": "etcd", **changes})


def test_tls_files_and_password_file(tmp_path: Path) -> None:
    ca, cert, key, password = (tmp_path / n for n in ("ca.pem", "cert.pem", "key.pem", "password"))
    for f in (ca, cert, key, password):
        f.write_text("x")
    os.chmod(password, 0o644)
    with pytest.raises(ConfigError, match=r"^etcd_cert_file, etcd_key_file: a client certificate needs both$"):
        ServiceConfig(etcd_ca_file=str(ca), etcd_cert_file=str(cert))
    with pytest.raises(ConfigError, match=r"^etcd_endpoints: http:// endpoints with TLS files set"):
        ServiceConfig(etcd_endpoints=("http://e:2379",), etcd_ca_file=str(ca))
    with pytest.raises(ConfigError, match=r"^etcd_password_file: .* is readable by others"):
        ServiceConfig(etcd_username="kv", etcd_password_file=str(password))
    os.chmod(password, 0o600)
    cfg = ServiceConfig(discovery="etcd", etcd_endpoints=("https://e:2379",), etcd_ca_file=str(ca),
                        etcd_cert_file=str(cert), etcd_key_file=str(key), etcd_username="kv",
                        etcd_password_file=str(password))
    assert cfg.etcd_endpoints == ("https://e:2379",)


def test_endpoints_parse() -> None:
    assert split_endpoint("etcd-0.etcd:2379") == ("", "etcd-0.etcd", 2379)
    assert split_endpoint("https://[fd00::1]:2379") == ("https", "fd00::1", 2379)
    assert ServiceConfig(etcd_endpoints=["a:1"]).etcd_endpoints == ("a:1",)  # type: ignore[arg-type]


def test_toml_and_environment() -> None:
    raw = {"service": {"discovery": "etcd", "cluster": "prod", "etcd_endpoints": ["e0:2379", "e1:2379"],
                       "discovery_name": "decode-0", "discovery_role": "decode"}}
    cfg = from_mapping(raw, {})
    assert (cfg.service.discovery, cfg.service.cluster, cfg.service.etcd_endpoints) == (
        "etcd", "prod", ("e0:2379", "e1:2379"))
    env = {"KVSERVICE_DISCOVERY": "etcd", "KVSERVICE_ETCD_ENDPOINTS": "a:1, b:2", "KVSERVICE_CLUSTER": "c1",
           "KVSERVICE_SERVICE_ETCD_TTL_S": "6", "KVSERVICE_SERVICE_ETCD_KEEPALIVE_S": "2"}
    cfg = from_mapping({}, env)
    assert (cfg.service.discovery, cfg.service.etcd_endpoints, cfg.service.cluster, cfg.service.etcd_ttl_s) == (
        "etcd", ("a:1", "b:2"), "c1", 6.0)
    assert from_mapping({"service": {"discovery": "etcd"}}, {}) == load_back(to_toml(from_mapping(
        {"service": {"discovery": "etcd"}}, {})))


def load_back(text: str) -> Any:
    import msgspec

    return from_mapping(msgspec.toml.decode(text.encode()), {})


@pytest.mark.parametrize(("raw", "env", "message"), [
    ({"service": {"discovery": "zk"}}, {}, r"^service\.discovery: must be one of static, etcd, got 'zk'$"),
    ({}, {"KVSERVICE_DISCOVERY": "zk"}, r"^service\.discovery \(from KVSERVICE_DISCOVERY='zk'\): must be one of"),
    ({}, {"KVSERVICE_ETCD_ENDPOINTS": "x"}, r"^service\.etcd_endpoints \(from KVSERVICE_ETCD_ENDPOINTS='x'\): "
                                            r"expected host:port"),
    ({}, {"KVSERVICE_SERVICE_ETCD_TTL_S": "ten"}, r"^service\.etcd_ttl_s \(from KVSERVICE_SERVICE_ETCD_TTL_S="
                                                  r"'ten'\): expected a number$"),
    ({"service": {"etcd_unreachable": "later"}}, {}, r"^service\.etcd_unreachable: must be one of wait, fail"),
])
def test_sidecar_errors_name_the_key(raw: dict[str, Any], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping(raw, env)
