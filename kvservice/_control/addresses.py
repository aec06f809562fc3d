"""Control addresses ("host:port"): parsing, and one canonical spelling per endpoint.

A peer may be named ``localhost:7100`` by one caller, ``127.0.0.1:7100`` by
another and advertise ``[::ffff:127.0.0.1]:7100`` itself; the control plane
keeps one link per peer by comparing canonical forms: the IP address (resolved
once, when the host is a name) and the port.
"""

from __future__ import annotations

import functools
import ipaddress
import socket

import anyio

#: longest host part accepted (a DNS name is at most 253 characters)
MAX_HOST_CHARS = 253


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); raises ``ValueError`` naming the problem."""
    if not isinstance(address, str):
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return _split(address)


@functools.lru_cache(maxsize=1024)  # every expect() checks its sender's: mostly the same few
def _split(address: str) -> tuple[str, int]:
    host, sep, port_s = address.rpartition(":")
    host = host.strip("[]")
    if (not sep or not host or len(host) > MAX_HOST_CHARS or not port_s.isascii() or not port_s.isdigit()
            or len(port_s) > 5 or not (0 < int(port_s) < 65536) or any(c.isspace() for c in host)):
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host, int(port_s)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP literal; any other name counts as not loopback."""
    if host.lower() in ("localhost", "localhost."):
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def is_unspecified_host(host: str) -> bool:
    """``0.0.0.0`` / ``::``: bindable, but nobody can dial it."""
    ip = _ip(host)
    return ip is not None and ip.is_unspecified


def literal_canonical(address: str) -> str | None:
    """The canonical form of an address whose host is an IP literal; None for a name."""
    host, port = split_address(address)
    ip = _ip(host)
    return None if ip is None else join_address(str(ip), port)


async def resolve_canonical(address: str) -> str:
    """The canonical form of ``address``, resolving a host name (IPv4 first).

    Raises ``ValueError`` for a malformed address and ``OSError`` when the name
    does not resolve."""
    literal = literal_canonical(address)
    if literal is not None:
        return literal
    host, port = split_address(address)
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host!r} does not resolve")
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, stable otherwise
    ip = _ip(str(infos[0][4][0]))
    assert ip is not None
    return join_address(str(ip), port)
