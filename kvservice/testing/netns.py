"""Network namespaces as "hosts" whose links can be cut: two joined by a veth (``wire``),
or any number joined through a bridge (``hub``).  Linux only; needs root (``ip netns``)
and iproute2.

Everything here is created by the run that uses it and removed by it, even when the run
fails or is interrupted: namespaces named ``<prefix>-<pid>-...`` (the pid of the creating
process, so runs side by side never share a name), the veths between them, and the
queueing disciplines put on those veths.  Nothing is added to the namespace the caller
runs in, so no traffic can leave the hosts made here.  Every ``ip``/``tc`` command is
bounded in time (``CMD_TIMEOUT_S``).

Topologies:

* ``wire()``: namespaces ``kvcut-<pid>-<n>-{a,b}`` joined by one veth pair,
  ``10.213.0.1/30`` and ``10.213.0.2/30``.
* ``hub(names)``: one namespace per name (``kvsoak-<pid>-<name>``) and a hub namespace
  (``kvsoak-<pid>-hub``) holding a bridge and, per host, the far end of that host's veth;
  the hosts get ``10.214.0.<k>/24``.  The hub holds no process, so deleting it takes every
  veth with it whatever still runs in the hosts.

Cuts (``Wire`` and ``Hub`` both):

* ``link_down``: ``ip link set dev VETH down`` on a host's end.  The other end loses its
  carrier; the kernel removes the down end's routes, so both directions stop.
* ``drop_all``: every packet leaving one end is dropped silently while the link stays up,
  as a broken switch or a black-holing route would: ``tc qdisc ... netem loss 100%`` where
  the kernel has ``sch_netem``, else the ``blackhole`` qdisc (identical for a 100% loss:
  the packet is accepted and freed, and TCP retransmits into the void).  Only that end's
  egress is dropped, so the connections are half-open: the other end's packets still
  arrive.  On a hub, a host's own end drops what it sends, the hub's end what it receives.

``shape`` limits one end's egress rate (``tbf``), so a large transfer stays in flight for
seconds and a cut lands on it whatever the machine's speed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .._results import KVServiceError

WIRE_PREFIX = "kvcut"
HUB_PREFIX = "kvsoak"
_SUBNET = "10.213.0"
_HUB_SUBNET = "10.214.0"
_BRIDGE = "kvbr0"
_names = itertools.count(1)
#: a command of ``ip``/``tc`` never takes this long; one that does is a fault of the machine
CMD_TIMEOUT_S = 10.0


class NetnsError(KVServiceError, RuntimeError):
    """An ``ip``/``tc`` command failed (a ``RuntimeError`` too, as callers caught it before)."""


def _run(*argv: str) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"{' '.join(argv)}: no exit within {CMD_TIMEOUT_S:g} s") from exc
    if proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


@dataclass(frozen=True)
class Host:
    """One end: a namespace, its veth and the address on it."""

    netns: str
    dev: str
    ip: str

    @property
    def prefix(self) -> tuple[str, ...]:
        """Command prefix that runs a program inside this namespace (``ip`` execs it: the
        program keeps the pid the caller started)."""
        return ("ip", "netns", "exec", self.netns)

    @property
    def ucx_env(self) -> dict[str, str]:
        """UCX over TCP on this host's veth, and nothing else."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.dev}

    def ip_cmd(self, *args: str) -> str:
        return _run("ip", "-n", self.netns, *args)

    def tc(self, *args: str) -> str:
        return _run("ip", "netns", "exec", self.netns, "tc", *args)

    def link_down(self) -> None:
        self.ip_cmd("link", "set", "dev", self.dev, "down")

    def link_up(self) -> None:
        self.ip_cmd("link", "set", "dev", self.dev, "up")

    def drop_all(self) -> str:
        """Drop every packet this end sends; returns the qdisc used."""
        try:
            self.tc("qdisc", "replace", "dev", self.dev, "root", "netem", "loss", "100%")
            return "netem"
        except NetnsError:
            self.tc("qdisc", "replace", "dev", self.dev, "root", "blackhole")
            return "blackhole"

    def unshape(self) -> None:
        """Back to the default qdisc (no shaping, no loss); a no-op if there is none to remove."""
        with contextlib.suppress(NetnsError):
            self.tc("qdisc", "del", "dev", self.dev, "root")


@dataclass(frozen=True)
class Wire:
    """Two hosts and the veth pair between them."""

    a: Host
    b: Host

    def link_down(self, host: Host) -> None:
        host.link_down()

    def link_up(self, host: Host) -> None:
        host.link_up()

    def drop_all(self, host: Host) -> str:
        """Drop every packet ``host`` sends on the wire; returns the qdisc used."""
        return host.drop_all()

    def shape(self, host: Host, rate: str) -> None:
        """Limit ``host``'s egress to ``rate`` (e.g. ``"200mbit"``)."""
        host.tc("qdisc", "replace", "dev", host.dev, "root", "tbf", "rate", rate,
                "burst", "256kb", "latency", "1s")

    def unshape(self, host: Host) -> None:
        """Back to the default qdisc (no shaping, no loss); a no-op if there is none to remove."""
        host.unshape()

    def queued(self) -> int:
        """Bytes in flight between the two hosts: the Send-Q and Recv-Q of every TCP
        connection between them, in both namespaces (``ss``).  Zero once whatever a
        cut left queued has been delivered or discarded."""
        total = 0
        for host, other in ((self.a, self.b), (self.b, self.a)):
            out = _run("ip", "netns", "exec", host.netns, "ss", "-tnH", "dst", other.ip)
            for line in out.splitlines():
                fields = line.split()
                total += int(fields[1]) + int(fields[2])  # State Recv-Q Send-Q Local Peer
        return total


#: the ways ``Hub.cut`` cuts a host off: its link down, or everything it sends (egress) or
#: everything sent to it (ingress) dropped
CUTS = ("link_down", "drop_egress", "drop_ingress")


@dataclass(frozen=True)
class Hub:
    """Hosts joined through a bridge in a namespace of its own (``hub()``)."""

    netns: str
    hosts: dict[str, Host]
    #: per host name: the hub's end of that host's veth (on the bridge)
    ports: dict[str, Host]

    def _end(self, name: str, how: str) -> Host:
        """The veth end a cut ``how`` acts on: the host's own, or (ingress) the hub's."""
        if how not in CUTS:
            raise ValueError(f"unknown cut {how!r}: one of {', '.join(CUTS)}")
        return self.ports[name] if how == "drop_ingress" else self.hosts[name]

    def cut(self, name: str, how: str) -> None:
        """Cut host ``name`` off the others (``how``: one of ``CUTS``); ``restore`` heals it."""
        end = self._end(name, how)
        if how == "link_down":
            end.link_down()
        else:  # every packet leaving that end dropped
            end.drop_all()

    def restore(self, name: str, how: str) -> None:
        """Undo ``cut(name, how)``: the same addresses and routes as before, and no neighbour
        entry the cut left ``FAILED`` (``flush_neighbours``)."""
        end = self._end(name, how)
        if how == "link_down":
            end.link_up()
        else:
            end.unshape()
        self.flush_neighbours()

    def flush_neighbours(self) -> None:
        """Forget every host's neighbour entries.  ARP that went unanswered during a cut leaves
        the peer's entry ``FAILED``, and packets to it then fail "No route to host" for a while
        after the link is back (seen as dials refused and links not made again for 17 s after a
        restore): the network is restored only once those are gone."""
        for host in self.hosts.values():
            with contextlib.suppress(NetnsError):
                host.ip_cmd("neigh", "flush", "dev", host.dev)

    @property
    def namespaces(self) -> list[str]:
        return [self.netns, *(h.netns for h in self.hosts.values())]


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None: creates and deletes a probe namespace."""
    if any(shutil.which(tool) is None for tool in ("ip", "tc", "ss")):
        return "needs Linux with iproute2 (ip, tc, ss)"
    probe = f"{WIRE_PREFIX}-{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", probe)
    except (NetnsError, OSError) as exc:
        return f"'ip netns add' refused (root or CAP_SYS_ADMIN needed): {exc}"
    try:
        _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
             "rate", "1gbit", "burst", "256kb", "latency", "1s")
    except NetnsError as exc:
        return f"the tbf qdisc (sch_tbf) is missing: {exc}"
    finally:
        _run("ip", "netns", "del", probe)
    return None


@contextlib.contextmanager
def wire() -> Iterator[Wire]:
    """Create two namespaces joined by a veth pair; remove both whatever happens."""
    n = next(_names)
    base = f"{WIRE_PREFIX}-{os.getpid()}-{n}"
    a = Host(f"{base}-a", f"kv{os.getpid() % 100000}x{n}a", f"{_SUBNET}.1")
    b = Host(f"{base}-b", f"kv{os.getpid() % 100000}x{n}b", f"{_SUBNET}.2")
    created: list[str] = []
    try:
        for host in (a, b):
            _run("ip", "netns", "add", host.netns)
            created.append(host.netns)
        # Both ends are made inside their namespaces: nothing appears in ours.
        _run("ip", "link", "add", a.dev, "netns", a.netns, "type", "veth", "peer", "name", b.dev, "netns", b.netns)
        for host in (a, b):
            host.ip_cmd("link", "set", "dev", "lo", "up")
            host.ip_cmd("addr", "add", f"{host.ip}/30", "dev", host.dev)
            host.ip_cmd("link", "set", "dev", host.dev, "up")
        yield Wire(a, b)
    finally:
        _remove(created, a.dev)


@contextlib.contextmanager
def hub(names: Sequence[str]) -> Iterator[Hub]:
    """One namespace per name in ``names`` (at most 250), each with a veth to a bridge in a
    hub namespace; remove them all whatever happens (an error, ``KeyboardInterrupt``)."""
    if not 0 < len(names) <= 250 or len(set(names)) != len(names):
        raise ValueError(f"hub: 1 to 250 distinct host names, not {list(names)}")
    pid = os.getpid()
    base = f"{HUB_PREFIX}-{pid}"
    center = f"{base}-hub"
    created: list[str] = []
    try:
        _run("ip", "netns", "add", center)
        created.append(center)
        _run("ip", "-n", center, "link", "add", _BRIDGE, "type", "bridge")
        _run("ip", "-n", center, "link", "set", "dev", _BRIDGE, "up")
        hosts: dict[str, Host] = {}
        ports: dict[str, Host] = {}
        for k, name in enumerate(names, 1):
            host = Host(f"{base}-{name}", f"kv{pid % 100000}h{k}", f"{_HUB_SUBNET}.{k}")
            port = Host(center, f"kv{pid % 100000}p{k}", "")
            _run("ip", "netns", "add", host.netns)
            created.append(host.netns)
            _run("ip", "link", "add", host.dev, "netns", host.netns, "type", "veth", "peer", "name", port.dev,
                 "netns", center)
            port.ip_cmd("link", "set", "dev", port.dev, "master", _BRIDGE)
            port.ip_cmd("link", "set", "dev", port.dev, "up")
            host.ip_cmd("link", "set", "dev", "lo", "up")
            host.ip_cmd("addr", "add", f"{host.ip}/24", "dev", host.dev)
            host.ip_cmd("link", "set", "dev", host.dev, "up")
            hosts[name], ports[name] = host, port
        yield Hub(center, hosts, ports)
    finally:
        # The hub first: it holds no process, so its veths go with it, and the hosts'
        # namespaces are left with nothing but their loopback.
        delete(created)


def _remove(namespaces: Sequence[str], dev: str) -> None:
    if namespaces:
        # The veth goes with its namespace, unless a process still lives in it: delete it first.
        with contextlib.suppress(NetnsError):
            _run("ip", "-n", namespaces[0], "link", "del", "dev", dev)
    delete(namespaces)


def delete(namespaces: Sequence[str]) -> None:
    """Delete every namespace named, in order, even after one fails; then raise what failed."""
    errors: list[str] = []
    for ns in namespaces:
        try:
            _run("ip", "netns", "del", ns)
        except NetnsError as exc:
            errors.append(str(exc))
    if errors:
        raise NetnsError("; ".join(errors))


def existing(netns: str) -> bool:
    return netns in listed()


def listed() -> list[str]:
    """The names of the namespaces ``ip netns`` knows now."""
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]
