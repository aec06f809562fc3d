"""Discovery's settings (``DiscoverySettings``): what each key means, checked here, in one place.

``discovery = "static"`` (the default) is the embedded behaviour: engines name peers by
``host:port`` and nothing else is consulted.  ``"etcd"`` registers this service in etcd
under ``/kvservice/<cluster>/services/<name>`` on a lease and watches its peers there
(``kvservice.discovery.registry``).

A service's configuration file and ``KVSERVICE_*`` overrides hold these keys flat, among
the service's own (``ServiceConfig`` declares them under the same names and builds its
``discovery_settings`` from them), so a bad value's error names the key as it is written
there.  Discovery reads only this type: it depends on nothing of the service's
configuration, and the configuration depends on it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from .._results import ConfigError

DISCOVERY = ("static", "etcd")
UNREACHABLE = ("wait", "fail")
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
    key on creation when a value cannot work."""

    #: "static": peers are named by host:port (nothing else consulted); "etcd": this service
    #: registers in etcd on a lease and finds peers there by name and role
    discovery: DiscoveryKind = "static"
    #: the key prefix /kvservice/<cluster>/ that this service's cluster shares
    cluster: str = "default"
    #: the name this service registers under (None: its agent name); unique in the cluster
    discovery_name: str | None = None
    #: what it does ("prefill", "decode", ...): peers list live members by role
    discovery_role: str = ""
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    #: the lease's time to live (whole seconds) and how often it is kept alive
    etcd_ttl_s: float = 10.0
    etcd_keepalive_s: float = 3.0
    #: a peer whose lease lapsed and that registers again with the same incarnation within
    #: this long was not lost (every lease lapses at once when etcd resumes after a stop)
    etcd_rejoin_grace_s: float = 5.0
    #: at start: how long one attempt to reach etcd may take, and then "fail" (raise) or
    #: "wait" (retry until etcd answers, saying so in the log)
    etcd_connect_timeout_s: float = 5.0
    etcd_unreachable: Unreachable = "fail"
    #: TLS: the CA of etcd's certificate; a client certificate and key; user name and a
    #: file (mode 0600) holding the password
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None
    etcd_username: str | None = None
    etcd_password_file: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.etcd_endpoints, list):  # from JSON or a table
            object.__setattr__(self, "etcd_endpoints", tuple(self.etcd_endpoints))
        _check(self)


def _check(cfg: DiscoverySettings) -> None:
    """Raise ``ConfigError`` naming the key for a discovery option that cannot work."""
    if cfg.discovery not in DISCOVERY:
        raise ConfigError(f"discovery: must be one of {', '.join(DISCOVERY)}, got {cfg.discovery!r}")
    if not isinstance(cfg.cluster, str) or not NAME.match(cfg.cluster):
        raise ConfigError(f"cluster: letters, digits, '.', '_', '-' (1..63, not starting with a symbol), "
                          f"got {cfg.cluster!r}")
    if cfg.discovery_name is not None and (not isinstance(cfg.discovery_name, str)
                                           or not NAME.match(cfg.discovery_name)):
        raise ConfigError(f"discovery_name: letters, digits, '.', '_', '-' (1..63), got {cfg.discovery_name!r}")
    if cfg.discovery_role and not NAME.match(cfg.discovery_role):
        raise ConfigError(f"discovery_role: letters, digits, '.', '_', '-' (1..63), got {cfg.discovery_role!r}")
    if cfg.etcd_unreachable not in UNREACHABLE:
        raise ConfigError(f"etcd_unreachable: must be one of {', '.join(UNREACHABLE)}, "
                          f"got {cfg.etcd_unreachable!r}")
    for key in ("etcd_ttl_s", "etcd_keepalive_s", "etcd_rejoin_grace_s", "etcd_connect_timeout_s"):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(f"{key}: must be a positive number, got {value!r}")
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
    for key in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_password_file"):
        path = getattr(cfg, key)
        if path is not None and (not isinstance(path, str) or not os.path.isfile(path)):
            raise ConfigError(f"{key}: no such file: {path!r}")
    if bool(cfg.etcd_username) != bool(cfg.etcd_password_file):
        raise ConfigError("etcd_username, etcd_password_file: etcd authentication needs both")
    if cfg.etcd_password_file is not None and os.stat(cfg.etcd_password_file).st_mode & 0o077:
        raise ConfigError(f"etcd_password_file: {cfg.etcd_password_file} is readable by others; chmod 600 it")
