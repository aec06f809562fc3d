"""Discovery's settings (``DiscoverySettings``): what each key means, checked here, in one place.

``discovery = "static"`` (the default) is the embedded behaviour: engines name peers by
``host:port`` and nothing else is consulted.  ``"etcd"`` registers this service in etcd
under ``/kvservice/<cluster>/services/<name>`` on a lease and watches its peers there
(``kvservice.discovery.registry``).

A service's configuration file and ``KVSERVICE_*`` overrides hold these keys flat, among
the service's own (``ServiceConfig`` inherits them from ``DiscoverySettings`` and builds its
``discovery_settings`` from them), so a bad value's error names the key as it is written
there.  Discovery reads only this type: it depends on nothing of the service's
configuration, and the configuration depends on it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal

from .._results import ConfigError
from .._settings import check_fields, declare

DiscoveryKind = Literal["static", "etcd"]
Unreachable = Literal["wait", "fail"]
#: a cluster, service or role name: it is a path segment of an etcd key
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_ENDPOINT = re.compile(r"^(?:(?P<scheme>https?)://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(?P<port>\d{1,5})$")


def split_endpoint(endpoint: str) -> tuple[str, str, int]:
    """``"https://etcd-0:2379"`` as (scheme, host, port); ValueError naming what is wrong."""
    m = _ENDPOINT.match(endpoint)
    if m is None or not 0 < int(m["port"]) <= 65535:
        raise ValueError(f"expected host:port or http(s)://host:port, got {endpoint!r}")
    return m["scheme"] or "", m["host"].strip("[]"), int(m["port"])


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    """Where a service registers and finds its peers; refused with ``ConfigError`` naming the
    key on creation when a value cannot work.  Each key is declared here once
    (``kvservice._settings.declare``); ``ServiceConfig`` holds them by inheriting them."""

    discovery: DiscoveryKind = field(default="static", metadata=declare(
        "static: peers are named by host:port; etcd: register on a lease and find peers by name and role"))
    cluster: str = field(default="default", metadata=declare(
        "the etcd key prefix /kvservice/<cluster>/ this service's cluster shares"))
    discovery_name: str | None = field(default=None, metadata=declare(
        "the name this service registers under, unique in the cluster (none: its agent name)"))
    discovery_role: str = field(default="", metadata=declare(
        "what this service does (prefill, decode, ...): peers list live members by role"))
    etcd_endpoints: tuple[str, ...] = field(default=("127.0.0.1:2379",), metadata=declare(
        "etcd's endpoints: host:port or http(s)://host:port"))
    etcd_ttl_s: float = field(default=10.0, metadata=declare(
        "the lease's time to live (whole seconds, at least 2)", above=0))
    etcd_keepalive_s: float = field(default=3.0, metadata=declare(
        "how often the lease is kept alive (under half of etcd_ttl_s)", above=0))
    #: every lease lapses at once when etcd resumes after a stop: a rejoin within this is no loss
    etcd_rejoin_grace_s: float = field(default=5.0, metadata=declare(
        "a peer whose lease lapsed and that registers again with the same incarnation within this long was not lost",
        above=0))
    etcd_connect_timeout_s: float = field(default=5.0, metadata=declare(
        "at start, how long one attempt to reach etcd may take", above=0))
    etcd_unreachable: Unreachable = field(default="fail", metadata=declare(
        "at start, when etcd does not answer: fail (raise) or wait (retry, saying so in the log)"))
    etcd_ca_file: str | None = field(default=None, metadata=declare(
        "TLS: the CA that signed etcd's certificate (required with https://)"))
    etcd_cert_file: str | None = field(default=None, metadata=declare("TLS: a client certificate (with etcd_key_file)"))
    etcd_key_file: str | None = field(default=None, metadata=declare(
        "TLS: the client certificate's key (with etcd_cert_file)"))
    etcd_username: str | None = field(default=None, metadata=declare(
        "etcd authentication: the user name (with etcd_password_file)"))
    etcd_password_file: str | None = field(default=None, metadata=declare(
        "etcd authentication: a file (mode 0600) holding the password"))

    def __post_init__(self) -> None:
        check_fields(self)  # a list of endpoints (JSON, a table) is held as a tuple
        check_discovery(self)


def check_discovery(cfg: DiscoverySettings) -> None:
    """Raise ``ConfigError`` naming the key for a discovery option that cannot work."""
    if not NAME.match(cfg.cluster):
        raise ConfigError(f"cluster: letters, digits, '.', '_', '-' (1..63, not starting with a symbol), "
                          f"got {cfg.cluster!r}")
    if cfg.discovery_name is not None and not NAME.match(cfg.discovery_name):
        raise ConfigError(f"discovery_name: letters, digits, '.', '_', '-' (1..63), got {cfg.discovery_name!r}")
    if cfg.discovery_role and not NAME.match(cfg.discovery_role):
        raise ConfigError(f"discovery_role: letters, digits, '.', '_', '-' (1..63), got {cfg.discovery_role!r}")
    if cfg.etcd_ttl_s < 2 or int(cfg.etcd_ttl_s) != cfg.etcd_ttl_s:
        raise ConfigError(f"etcd_ttl_s: etcd leases are whole seconds, at least 2, got {cfg.etcd_ttl_s!r}")
    if cfg.etcd_keepalive_s >= cfg.etcd_ttl_s / 2:
        raise ConfigError(f"etcd_keepalive_s: must be under half of etcd_ttl_s ({cfg.etcd_ttl_s}) so that "
                          f"one lost keep-alive does not lapse the lease, got {cfg.etcd_keepalive_s!r}")
    if not cfg.etcd_endpoints:
        raise ConfigError("etcd_endpoints: must list at least one host:port")
    schemes = set()
    for endpoint in cfg.etcd_endpoints:
        try:
            schemes.add(split_endpoint(endpoint)[0])
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"etcd_endpoints: {exc}") from None
    tls = bool(cfg.etcd_ca_file or cfg.etcd_cert_file or cfg.etcd_key_file)
    if "http" in schemes and tls:
        raise ConfigError("etcd_endpoints: http:// endpoints with TLS files set; use https:// (or host:port)")
    if "https" in schemes and not cfg.etcd_ca_file:
        raise ConfigError("etcd_ca_file: required with https:// endpoints (the CA that signed etcd's certificate)")
    if bool(cfg.etcd_cert_file) != bool(cfg.etcd_key_file):
        raise ConfigError("etcd_cert_file, etcd_key_file: a client certificate needs both")
    for name in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_password_file"):
        path = getattr(cfg, name)
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{name}: no such file: {path!r}")
    if bool(cfg.etcd_username) != bool(cfg.etcd_password_file):
        raise ConfigError("etcd_username, etcd_password_file: etcd authentication needs both")
    if cfg.etcd_password_file is not None and os.stat(cfg.etcd_password_file).st_mode & 0o077:
        raise ConfigError(f"etcd_password_file: {cfg.etcd_password_file} is readable by others; chmod 600 it")
