"""Two network namespaces joined by a veth pair: two "hosts" whose link a test can cut.

Everything here is created by the test run that uses it and removed by it:
namespaces named ``kvcut-<pid>-<n>-{a,b}``, one veth pair between them with
``10.213.0.1/30`` and ``10.213.0.2/30`` inside the namespaces, and the queueing
disciplines put on those veths.  Nothing is added to the namespace the tests run
in, so no traffic can leave the pair.  Needs root (``ip netns``) and iproute2.

Cuts:

* ``link_down``: ``ip link set dev VETH down`` on one end.  The other end loses
  its carrier; the kernel removes the down end's routes, so both directions stop.
* ``loss``: every packet leaving one end is dropped silently while the link stays
  up, as a broken switch or a black-holing route would: ``tc qdisc ... netem
  loss 100%`` where the kernel has ``sch_netem``, else the ``blackhole`` qdisc
  (identical for a 100% loss: the packet is accepted and freed, and TCP
  retransmits into the void).  Only that end's egress is dropped, so the
  connections are half-open: the other end's packets still arrive.

``shape`` limits one end's egress rate (``tbf``), so a large transfer stays in
flight for seconds and a cut lands on it whatever the machine's speed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

_PREFIX = "kvcut"
_SUBNET = "10.213.0"
_names = itertools.count(1)
#: a command of ``ip``/``tc`` never takes this long; one that does is a fault of the machine
_CMD_TIMEOUT_S = 10.0


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed."""


def _run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
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
        """Command prefix that runs a program inside this namespace (``ip`` execs it)."""
        return ("ip", "netns", "exec", self.netns)

    @property
    def ucx_env(self) -> dict[str, str]:
        """UCX over TCP on this host's veth, and nothing else."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.dev}

    def ip_cmd(self, *args: str) -> str:
        return _run("ip", "-n", self.netns, *args)

    def tc(self, *args: str) -> str:
        return _run("ip", "netns", "exec", self.netns, "tc", *args)


@dataclass(frozen=True)
class Wire:
    """Two hosts and the veth pair between them."""

    a: Host
    b: Host

    def link_down(self, host: Host) -> None:
        host.ip_cmd("link", "set", "dev", host.dev, "down")

    def link_up(self, host: Host) -> None:
        host.ip_cmd("link", "set", "dev", host.dev, "up")

    def drop_all(self, host: Host) -> str:
        """Drop every packet ``host`` sends on the wire; returns the qdisc used."""
        try:
            host.tc("qdisc", "replace", "dev", host.dev, "root", "netem", "loss", "100%")
            return "netem"
        except NetnsError:
            host.tc("qdisc", "replace", "dev", host.dev, "root", "blackhole")
            return "blackhole"

    def shape(self, host: Host, rate: str) -> None:
        """Limit ``host``'s egress to ``rate`` (e.g. ``"200mbit"``)."""
        host.tc("qdisc", "replace", "dev", host.dev, "root", "tbf", "rate", rate,
                "burst", "256kb", "latency", "1s")

    def unshape(self, host: Host) -> None:
        """Back to the default qdisc (no shaping, no loss); a no-op if there is none to remove."""
        with contextlib.suppress(NetnsError):
            host.tc("qdisc", "del", "dev", host.dev, "root")

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


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None: creates and deletes a probe namespace."""
    if any(shutil.which(tool) is None for tool in ("ip", "tc", "ss")):
        return "needs Linux with iproute2 (ip, tc, ss)"
    probe = f"{_PREFIX}-{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", probe)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        return f"'ip netns add' refused (root or CAP_SYS_ADMIN needed): {exc}"
    try:
        _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
             "rate", "1gbit", "burst", "256kb", "latency", "1s")
    except NetnsError as exc:
        return f"the tbf qdisc (sch_tbf) is missing: {exc}"
    finally:
        _run("ip", "netns", "del", probe)
    return None


def require() -> None:
    """Skip the calling test, saying why, where namespaces cannot be used here; fail it
    instead when ``KVSERVICE_REQUIRE_NETNS`` is set (a CI machine that must run them)."""
    why = unavailable()
    if why is not None:
        if os.environ.get("KVSERVICE_REQUIRE_NETNS"):
            pytest.fail(f"KVSERVICE_REQUIRE_NETNS is set, but {why}")
        pytest.skip(why)


@contextlib.contextmanager
def wire() -> Iterator[Wire]:
    """Create two namespaces joined by a veth pair; remove both whatever happens."""
    n = next(_names)
    base = f"{_PREFIX}-{os.getpid()}-{n}"
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
    return netns in _run("ip", "netns", "list").split()
