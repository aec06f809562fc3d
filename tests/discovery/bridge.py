"""Hosts on a switch: one network namespace per host, each joined by a veth pair to a
bridge that lives in a namespace of its own (``kvbr-<pid>-sw``), so nothing is added to the
namespace the tests run in and no traffic can leave the switch.  Addresses are private
(``10.214.0.0/24``).  Everything is created by the test that uses it and removed by it
(``tests/faults/netns.py`` for the two-host pair this generalises).  Needs root and iproute2."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

from tests.faults.netns import Host, NetnsError, _run, delete

_PREFIX = "kvbr"
SUBNET = "10.214.0"


class Switch:
    def __init__(self, hosts: dict[str, Host], netns: str) -> None:
        self.hosts = hosts
        self.netns = netns

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def unplug(self, host: Host) -> None:
        """The host's link down: it loses its carrier and its routes, both directions stop."""
        host.ip_cmd("link", "set", "dev", host.dev, "down")

    def plug(self, host: Host) -> None:
        host.ip_cmd("link", "set", "dev", host.dev, "up")
        # forget neighbour entries the cut left FAILED, on every host (see test_network_cut)
        for h in self.hosts.values():
            with contextlib.suppress(NetnsError):
                h.ip_cmd("neigh", "flush", "dev", h.dev)


@contextlib.contextmanager
def switch(names: Sequence[str]) -> Iterator[Switch]:
    """One namespace per name (``kvbr-<pid>-<name>``, address ``10.214.0.<i+1>``) on a bridge."""
    pid = os.getpid() % 10000
    sw = f"{_PREFIX}-{os.getpid()}-sw"
    created: list[str] = []
    hosts: dict[str, Host] = {}
    try:
        _run("ip", "netns", "add", sw)
        created.append(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "dev", "br0", "up")
        for i, name in enumerate(names):
            host = Host(f"{_PREFIX}-{os.getpid()}-{name}", f"kb{pid}h{i}", f"{SUBNET}.{i + 1}")
            _run("ip", "netns", "add", host.netns)
            created.append(host.netns)
            port = f"kb{pid}s{i}"
            _run("ip", "link", "add", host.dev, "netns", host.netns, "type", "veth", "peer", "name", port,
                 "netns", sw)
            _run("ip", "-n", sw, "link", "set", "dev", port, "master", "br0")
            _run("ip", "-n", sw, "link", "set", "dev", port, "up")
            host.ip_cmd("link", "set", "dev", "lo", "up")
            host.ip_cmd("addr", "add", f"{host.ip}/24", "dev", host.dev)
            host.ip_cmd("link", "set", "dev", host.dev, "up")
            hosts[name] = host
        yield Switch(hosts, sw)
    finally:
        delete(created[::-1])  # the veths go with their namespaces
