"""``kvservice bench --listen HOST:PORT``: the receiving side of a two-host run.

It waits (at most ``--wait`` seconds) for one driver (``kvservice bench --peer``)
that passes the handshake; a connection that fails it is logged and closed, and
the wait goes on.  Then it serves that one session: answers clock probes, starts
its receiving children when the driver's ``Setup`` comes (a raw-NIXL receiver and
a kvservice receiver, on this host's UCX transports and devices), relays the
driver's checked commands to them and their replies back, and ends on ``Stop``
(printing the driver's report), an error, EOF, or ``IDLE_TIMEOUT_S`` of silence.
Its last line on stdout says how the session ended; the exit status says it too.
"""

from __future__ import annotations

import ipaddress
import selectors
import socket
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from kvservice._control.addresses import join_address, split_address
from kvservice._exits import EXIT_FAILED, EXIT_OK
from kvservice.bench import control
from kvservice.bench._lines import Child, ChildError
from kvservice.bench.control import Channel, ControlError
from kvservice.bench.methods import SETUP_TIMEOUT_S
from kvservice.bench.workloads import FULL, LLAMA3_8B, QUICK

#: silence from the driver this long ends the session (a run is at most ``RUN_TIMEOUT_S``)
IDLE_TIMEOUT_S = 400.0
#: a frame that has begun must be whole within this
FRAME_TIMEOUT_S = 30.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def say(msg: str) -> None:
    """A line for the operator on stdout: where it listens, and how the session ended."""
    print(f"kvservice bench --listen: {msg}", flush=True)


def _version() -> str:
    try:
        return version("kvservice")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class ListenOptions:
    host: str
    port: int  # 0: any free port
    wait_s: float
    key: bytes | None  # the bench key (``control.bench_key``), or None
    key_file: str | None  # the cluster key file, for this side's kvservice
    allow_unauthenticated: bool
    ucx: dict[str, str | None]  # UCX_TLS / UCX_NET_DEVICES for the children (None: unset)


def listen(opts: ListenOptions) -> int:
    host, port = opts.host, opts.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, port))
        server.listen(8)
        bound = join_address(host, server.getsockname()[1])
        say(f"listening on {bound} ({'authenticated' if opts.key else 'NOT authenticated'}); "
            f"waiting up to {opts.wait_s:.0f} s for `kvservice bench --peer {bound}`")
        deadline = time.monotonic() + opts.wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                say(f"FAILED: no peer completed the handshake within {opts.wait_s:.0f} s")
                return EXIT_FAILED
            server.settimeout(left)
            try:
                conn, addr = server.accept()
            except TimeoutError:
                continue
            peer = join_address(addr[0], addr[1])
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            chan = Channel(conn, peer)
            try:
                control.listener_handshake(chan, opts.key, _version())
            except ControlError as exc:
                log(f"kvservice bench --listen: refused {peer}: {exc}")
                conn.close()
                continue
            break
    with conn:
        log(f"kvservice bench --listen: session with {peer}")
        return Session(chan, opts, local_ip=str(conn.getsockname()[0]), driver_ip=str(addr[0])).run()


class Session:
    """One driver's session: its receiving children and the relay between them and it."""

    def __init__(self, chan: Channel, opts: ListenOptions, *, local_ip: str, driver_ip: str) -> None:
        self.chan, self.opts = chan, opts
        self.local_ip, self.driver_ip = local_ip, driver_ip
        self.children: dict[str, Child] = {}
        self.num_pages = 0
        self.relayed = 0

    def run(self) -> int:
        try:
            code, report = self._serve()
        except (ControlError, ChildError) as exc:
            self.chan.try_error(f"listener: {exc}")
            say(f"FAILED: session with {self.chan.peer}: {exc}")
            return EXIT_FAILED
        finally:
            self._close_children()
        if report:
            print(report, flush=True)
        say(f"{'done' if code == EXIT_OK else 'FAILED (the driver reported a failure)'}: session with "
            f"{self.chan.peer}, {self.relayed} replies relayed")
        return code

    def _close_children(self) -> None:
        for child in self.children.values():
            child.close(timeout=5)
        self.children = {}

    def _serve(self) -> tuple[int, str]:
        sel = selectors.DefaultSelector()
        sel.register(self.chan.sock, selectors.EVENT_READ, None)
        idle_deadline = time.monotonic() + IDLE_TIMEOUT_S
        try:
            while True:
                left = idle_deadline - time.monotonic()
                if left <= 0:
                    raise ControlError(f"{self.chan.peer} was silent for {IDLE_TIMEOUT_S:.0f} s")
                for key, _ in sel.select(timeout=min(left, 1.0)):
                    if key.data is not None:
                        for msg in self.children[key.data].read_ready():
                            self.chan.send(control.Relay(source=key.data, msg=msg), timeout=FRAME_TIMEOUT_S)
                            self.relayed += 1
                        continue
                    msg = self.chan.recv(control.ToListener, time.monotonic() + FRAME_TIMEOUT_S)
                    idle_deadline = time.monotonic() + IDLE_TIMEOUT_S
                    if isinstance(msg, control.Stop):
                        self._close_children()
                        self.chan.send(control.Bye())
                        return (EXIT_OK if msg.ok else EXIT_FAILED), msg.report
                    for name, child in self._handle(msg):
                        sel.register(child.fd, selectors.EVENT_READ, name)
        finally:
            sel.close()

    def _handle(self, msg: Any) -> list[tuple[str, Child]]:
        """Act on one frame of the driver's; returns children started by it."""
        if isinstance(msg, control.Clock):
            self.chan.send(control.Clock(t=msg.t, now=time.monotonic()))
        elif isinstance(msg, control.Setup):
            if self.children:
                raise ControlError(f"{self.chan.peer} sent a second setup")
            return self._start(msg)
        elif isinstance(msg, control.ToRaw):
            child = self._child("raw_nixl")
            if isinstance(msg.cmd, control.RawConnect) and msg.cmd.prep:
                raise ControlError("the receiving raw-NIXL side prepares no remote descriptors (prep must be false)")
            self._forward(child, msg.cmd)
        elif isinstance(msg, control.ToKv):
            child = self._child("kvservice")
            self._check_kv(msg.cmd)
            self._forward(child, msg.cmd)
        else:
            raise ControlError(f"{self.chan.peer} sent an unexpected {type(msg).__name__.lower()}")
        return []

    def _child(self, name: str) -> Child:
        child = self.children.get(name)
        if child is None:
            raise ControlError(f"{self.chan.peer} sent a command for {name}, which was not set up")
        return child

    def _check_kv(self, cmd: control.KvExpect) -> None:
        """The receiver's pages must lie in its pool, and it dials only the driver's host."""
        for r in cmd.requests:
            if max(r.dst) >= self.num_pages:
                raise ControlError(f"request {r.rid!r}: page {max(r.dst)} is outside the pool of {self.num_pages}")
        try:
            host, _ = split_address(cmd.sender)
            same = ipaddress.ip_address(host) == ipaddress.ip_address(self.driver_ip)
        except ValueError:
            same = False
        if not same:
            raise ControlError(f"the sender to dial, {cmd.sender!r}, is not on the driver's host {self.driver_ip}")

    @staticmethod
    def _forward(child: Child, cmd: Any) -> None:
        line = control.as_line(cmd)
        child.send(line.pop("op"), **line)

    def _start(self, setup: control.Setup) -> list[tuple[str, Child]]:
        plan = QUICK if setup.plan == "quick" else FULL
        self.num_pages = plan.pool_pages
        env = self.opts.ucx
        service: dict[str, Any] = {"host": self.local_ip,
                                   "ucx_env": {k: v for k, v in env.items() if v is not None}}
        if self.opts.key_file:
            service["auth_key_file"] = self.opts.key_file
        if self.opts.allow_unauthenticated:
            service["allow_unauthenticated"] = True
        for name in dict.fromkeys(setup.methods):
            if name == "raw_nixl":
                cfg: dict[str, Any] = {"layout": LLAMA3_8B, "num_pages": plan.pool_pages, "progress_thread": False}
                self.children[name] = Child("kvservice.bench.raw_nixl", "recv", cfg, env=env)
            else:
                cfg = {"layout": LLAMA3_8B, "num_pages": plan.pool_pages, "loop": setup.loop, "gc": setup.gc,
                       "service": service}
                self.children[name] = Child("kvservice.bench.kv_side", "recv", cfg, env=env)
        log(f"kvservice bench --listen: {setup.plan} plan, receivers {', '.join(self.children)} "
            f"starting (up to {SETUP_TIMEOUT_S:.0f} s)")
        return list(self.children.items())
