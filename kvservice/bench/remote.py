"""The driving side of a two-host run: its link to the listener, and the listener's
receiving children as ``RemoteChild`` endpoints that the methods drive exactly as
they drive a local ``Child``.

The listener is a peer that may be hostile or broken: each reply of its children
is checked before anything here uses it (``_checked``), a receiver's timestamps
are moved onto this host's clock by the offset measured at the start (``Link.
sync_clock``), and every wait has a deadline.
"""

from __future__ import annotations

import socket
import time
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from kvservice.bench import control
from kvservice.bench._lines import ChildError
from kvservice.bench.control import Channel, ControlError

CONNECT_RETRY_S = 0.25
CLOCK_SAMPLES = 16
#: how many replies of the listener's children wait here unread before it is a fault
MAX_BACKLOG = 10_000


class _RawReady(Struct):
    metadata: Annotated[str, Meta(max_length=2**20)]
    base: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    num_pages: Annotated[int, Meta(ge=1, le=control.MAX_PAGES)]


class _Arrived(Struct):
    last: float
    nfailed: Annotated[int, Meta(ge=0)] = 0
    missing: Annotated[int, Meta(ge=0)] = 0


def dial(address: tuple[str, int], wait_s: float) -> socket.socket:
    """A TCP connection to the listener, retried while it is not listening yet (for at most ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=min(control.HANDSHAKE_TIMEOUT_S, wait_s))
        except (ConnectionRefusedError, TimeoutError, OSError) as exc:
            if time.monotonic() + CONNECT_RETRY_S >= deadline:
                raise ControlError(f"cannot connect to {address[0]}:{address[1]}: {exc}") from exc
            time.sleep(CONNECT_RETRY_S)
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return sock


class Link:
    """The authenticated session with the listener, as seen by the driver."""

    def __init__(self, chan: Channel, num_pages: int) -> None:
        self.chan = chan
        self.num_pages = num_pages  # what the listener's raw receiver must report
        self.offset = 0.0  # the listener's monotonic clock minus this host's
        self.rtt_s = 0.0
        self.backlog: dict[str, list[dict[str, Any]]] = {"raw_nixl": [], "kvservice": []}
        self.welcome = ""

    @property
    def local_ip(self) -> str:
        """This host's address on the route to the listener: where its services bind."""
        return str(self.chan.sock.getsockname()[0])

    def sync_clock(self) -> None:
        """The offset of the listener's clock, from the round trip with the smallest delay."""
        samples = []
        for _ in range(CLOCK_SAMPLES):
            t0 = time.monotonic()
            self.chan.send(control.Clock(t=t0))
            got: control.Clock = self.chan.recv(control.Clock, time.monotonic() + control.HANDSHAKE_TIMEOUT_S)
            t1 = time.monotonic()
            if got.t != t0:
                raise ControlError(f"{self.chan.peer} answered a clock probe out of order")
            samples.append((t1 - t0, got.now - (t0 + t1) / 2))
        self.rtt_s, self.offset = min(samples)  # the least delayed probe bounds the error best

    def setup(self, plan: str, methods: list[str], loop: str, gc: str) -> None:
        self.chan.send(control.Setup(plan=plan, methods=methods, loop=loop, gc=gc))  # type: ignore[arg-type]

    def child(self, name: str) -> RemoteChild:
        return RemoteChild(self, name)

    def pump(self, deadline: float) -> None:
        """Read one frame: a relayed reply goes to its child's backlog."""
        try:
            msg = self.chan.recv(control.ToDriver, deadline)
        except ControlError as exc:
            raise ChildError(f"listener: {exc}") from exc
        if not isinstance(msg, control.Relay):
            raise ChildError(f"listener {self.chan.peer} sent {type(msg).__name__.lower()} during the run")
        box = self.backlog[msg.source]
        if len(box) >= MAX_BACKLOG:
            raise ChildError(f"listener {self.chan.peer} floods replies of its {msg.source} receiver")
        box.append(self._checked(msg.source, msg.msg))

    def _checked(self, source: str, msg: dict[str, Any]) -> dict[str, Any]:
        """The fields of a relayed reply that this side uses, checked; timestamps moved to this clock."""
        event = msg.get("event")
        try:
            if event == "ready" and source == "raw_nixl":
                ready = msgspec.convert(msg, _RawReady)
                if ready.num_pages != self.num_pages:
                    raise ChildError(f"the listener's raw receiver has {ready.num_pages} pages, not {self.num_pages}")
            elif event == "arrived":
                arrived = msgspec.convert(msg, _Arrived)
                msg["last"] = arrived.last - self.offset
            elif event == "error":
                msg["message"] = str(msg.get("message"))[:2000]
        except msgspec.ValidationError as exc:
            raise ChildError(f"listener {self.chan.peer}: invalid {event!r} reply of its {source}: {exc}") from exc
        return msg

    def stop(self, ok: bool, report: str) -> None:
        """End the session; the listener answers ``Bye`` once its children are gone."""
        self.chan.send(control.Stop(ok=ok, report=report[: 2**16]))
        deadline = time.monotonic() + 60.0
        while True:
            msg = self.chan.recv(control.ToDriver, deadline)
            if isinstance(msg, control.Bye):
                return

    def close(self) -> None:
        self.chan.sock.close()


class RemoteChild:
    """A receiving child on the listener, with ``Child``'s calls: commands go out as
    ``ToRaw``/``ToKv``, replies come back relayed."""

    def __init__(self, link: Link, source: str) -> None:
        self.link = link
        self.source = source
        self.name = f"{source}:recv@{link.chan.peer}"

    def send(self, op: str, **kw: Any) -> None:
        line = {"op": op, **kw}
        try:
            if self.source == "raw_nixl":
                cmd: control.ToRaw | control.ToKv = control.ToRaw(
                    cmd=msgspec.convert(line, control.RawConnect | control.RawExpect))
            else:
                cmd = control.ToKv(cmd=msgspec.convert(line, control.KvExpect))
            self.link.chan.send(cmd)
        except (msgspec.ValidationError, ControlError) as exc:
            raise ChildError(f"{self.name}: {exc}") from exc

    def wait(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        box = self.link.backlog[self.source]
        while True:
            for i, msg in enumerate(box):
                if msg.get("event") == "error":
                    raise ChildError(f"{self.name}: {msg.get('message')}")
                if msg.get("event") == event:
                    return box.pop(i)
            if time.monotonic() >= deadline:
                raise ChildError(f"{self.name} did not answer in time")
            self.link.pump(deadline)

    def call(self, op: str, event: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.wait(event, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """The listener stops its children when the session ends."""
