"""The methods compared, each behind the same three calls: ``start``, ``measure``, ``close``.

``measure(case, prefix)`` moves every request of ``case`` once and returns a
sample: ``start``/``end`` (``time.monotonic()``, which is one clock for every
process of the machine), per-request ``latencies`` (seconds), and for
kvservice and the sidecar the sending worker's loop ``lags`` (when ``case.lag``).  A two-process
run ends when both the sender has seen its last completion and the receiver
its last arrival.
"""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvservice import KVLayout
from kvservice.bench import _lines, mooncake_side
from kvservice.bench._lines import CHILD_ENV, Child, ChildError
from kvservice.bench.limit import CopyLimit
from kvservice.bench.workloads import Case
from kvservice.sidecar.local import DaemonError, LocalDaemon, short_tmpdir
from kvservice.sidecar.shm import SHM_DIR

if TYPE_CHECKING:
    from kvservice.bench.remote import Link

SETUP_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 180.0
#: the sidecar's socket directory (under /tmp) and shared segments (under /dev/shm) start with
#: this and the driver's pid
NAME_PREFIX = "kvs-bench-"


class Endpoint(Protocol):
    """One side of a method: a local ``Child``, or a ``RemoteChild`` on the listening host."""

    name: str

    def send(self, op: str, **kw: Any) -> None: ...
    def wait(self, event: str, timeout: float = 60.0) -> dict[str, Any]: ...
    def call(self, op: str, event: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]: ...
    def close(self, timeout: float = 10.0) -> None: ...


class Method(Protocol):
    """``close`` is safe on a method never started, or whose ``start`` failed part way
    (a sidecar's daemons are up before its workers start): it stops what is up."""

    name: str

    def start(self) -> None: ...
    def measure(self, case: Case, prefix: str) -> dict[str, Any]: ...
    def close(self) -> None: ...


@contextmanager
def running(methods: Sequence[Method]) -> Iterator[None]:
    """Start ``methods`` in order; on the way out close every one of them, those already
    started when a later start failed, and the one whose start failed (its processes up by
    then are stopped, never left behind the driver)."""
    try:
        for m in methods:
            m.start()
        yield
    finally:
        for m in methods:
            m.close()


class Limit:
    """The local memory-copy limit (in the driver process)."""

    name = "limit"

    def __init__(self, layout: dict[str, Any], num_pages: int) -> None:
        self._layout, self._pages = layout, num_pages
        self._copy: CopyLimit | None = None

    def start(self) -> None:
        self._copy = CopyLimit(self._layout, self._pages)

    def measure(self, case: Case, prefix: str) -> dict[str, Any]:
        assert self._copy is not None
        return self._copy.run(case.with_prefix(prefix))

    def close(self) -> None:
        if self._copy is not None:
            self._copy.close()
            self._copy = None


def _two_sided(sample: dict[str, Any], arrived: dict[str, Any], n: int) -> dict[str, Any]:
    if sample.get("nfailed") or arrived.get("nfailed") or arrived.get("missing"):
        raise ChildError(f"requests failed: sender {sample.get('failed')}, receiver {arrived}")
    if sample["ok"] != n:
        raise ChildError(f"{sample['ok']} of {n} requests completed")
    sample["recv_last"] = arrived["last"]
    sample["end"] = max(sample["end"], arrived["last"])
    return sample


def processes(m: Method) -> dict[str, int]:
    """The method's processes on this host, by role: ``send`` and ``recv`` (its children),
    and for the sidecar each daemon (``prefill-daemon``, ``decode-daemon``).  A remote
    endpoint (a two-host run's receiver) and the in-driver limit have none."""
    out: dict[str, int] = {}
    for role in ("send", "recv"):
        pid = getattr(getattr(m, role, None), "pid", None)
        if pid is not None:
            out[role] = pid
    for d in getattr(m, "daemons", []):
        out[f"{d.role}-daemon"] = d.pid
    return out


#: which side of a transfer each process role works for
SIDES = {"send": "send", "prefill-daemon": "send", "recv": "recv", "decode-daemon": "recv"}


class _TwoChildren:
    """A method measured by a sending and a receiving child process."""

    send: Endpoint | None
    recv: Endpoint | None

    def close(self) -> None:
        for child in (self.send, self.recv):
            if child is not None:
                child.close()


class RawNixl(_TwoChildren):
    """Hand-written NIXL loop in two child processes (``kvservice.bench.raw_nixl``).

    ``remote``: the receiver is the listening host's (two-host runs); ``env``: UCX's
    variables for the local child (``Child``'s ``env``)."""

    name = "raw_nixl"

    def __init__(self, layout: dict[str, Any], num_pages: int, *, env: dict[str, str | None] | None = None,
                 remote: Link | None = None, name: str = "raw_nixl", **options: Any) -> None:
        self.name = name
        self._cfg = {"layout": layout, "num_pages": num_pages, "progress_thread": False, **options}
        self._env, self._remote = env, remote
        self.send: Endpoint | None = None
        self.recv: Endpoint | None = None

    def start(self) -> None:
        self.send = Child("kvservice.bench.raw_nixl", "send", self._cfg, env=self._env)
        self.recv = (self._remote.child(self.name) if self._remote is not None
                     else Child("kvservice.bench.raw_nixl", "recv", self._cfg, env=self._env))
        hs, hr = self.send.wait("ready", SETUP_TIMEOUT_S), self.recv.wait("ready", SETUP_TIMEOUT_S)
        self.recv.call("connect", "connected", metadata=hs["metadata"], base=hs["base"],
                       num_pages=hs["num_pages"], prep=False)
        self.send.call("connect", "connected", metadata=hr["metadata"], base=hr["base"],
                       num_pages=hr["num_pages"], prep=True)

    def measure(self, case: Case, prefix: str) -> dict[str, Any]:
        assert self.send is not None and self.recv is not None
        reqs = case.with_prefix(prefix)
        self.recv.call("expect", "expecting", rids=[r["rid"] for r in reqs])
        sample = self.send.call("run", "done", RUN_TIMEOUT_S, requests=reqs, concurrency=case.concurrency)
        return _two_sided(sample, self.recv.wait("arrived", RUN_TIMEOUT_S), len(reqs))


class _ApiChildren(_TwoChildren):
    """Two children on kvservice's API (``kvservice.bench.kv_side``'s protocol): the
    receiver expects every request of a run up front, then the sender runs them."""

    address = ""  # the sending service's control address, the receiver's ``sender``
    records_lag = True  # its sender probes its loop's lag in a run that asks (``Case.lag``)

    def measure(self, case: Case, prefix: str) -> dict[str, Any]:
        assert self.send is not None and self.recv is not None
        reqs = case.with_prefix(prefix)
        self.recv.call("expect", "expecting", RUN_TIMEOUT_S, requests=reqs, sender=self.address)
        sample = self.send.call("run", "done", RUN_TIMEOUT_S, requests=reqs, concurrency=case.concurrency,
                                lag=case.lag)
        return _two_sided(sample, self.recv.wait("arrived", RUN_TIMEOUT_S), len(reqs))


class KvService(_ApiChildren):
    """kvservice's public API in two child processes (``kvservice.bench.kv_side``)."""

    name = "kvservice"

    def __init__(self, layout: dict[str, Any], num_pages: int, *, loop: str = "uvloop", gc: str = "freeze",
                 service: dict[str, Any] | None = None, name: str = "kvservice",
                 path_first: Path | None = None, env: dict[str, str | None] | None = None,
                 remote: Link | None = None, sides: dict[str, dict[str, Any]] | None = None) -> None:
        """``path_first``: a directory holding another ``kvservice`` package for the two
        processes to import instead of this checkout's (see ``benchmarks/compare.py`` in the repository).
        ``sides``: settings of one side only, by side ("send", "recv"), over ``service``."""
        self.name = name
        self.path_first = path_first
        self.cfg: dict[str, Any] = {"layout": layout, "num_pages": num_pages, "loop": loop, "gc": gc,
                                    "service": service or {}}
        self.sides = sides or {}
        self.env, self.remote = env, remote
        self.send: Endpoint | None = None
        self.recv: Endpoint | None = None
        self.address = ""

    def start(self) -> None:
        self.send = Child("kvservice.bench.kv_side", "send", self._side("send"), path_first=self.path_first,
                          env=self.env)
        self.recv = (self.remote.child(self.name) if self.remote is not None else
                     Child("kvservice.bench.kv_side", "recv", self._side("recv"), path_first=self.path_first,
                           env=self.env))
        self.address = self.send.wait("ready", SETUP_TIMEOUT_S)["address"]
        self.recv.wait("ready", SETUP_TIMEOUT_S)

    def _side(self, side: str) -> dict[str, Any]:
        return {**self.cfg, "service": {**self.cfg["service"], **self.sides.get(side, {})}}


class Sidecar(_ApiChildren):
    """kvservice as a sidecar: a ``kvservice serve`` daemon per side and a worker
    process on each driving the public ``SidecarClient`` API (``kvservice.bench.sidecar_side``).

    The workers do what ``KvService``'s two processes do, with the same requests,
    clients and sample; the daemons are configured as those processes' services
    are (this layout and pool size, loopback, defaults otherwise).  So the
    difference to ``kvservice`` is what the sidecar costs: a hop over a Unix
    socket for every call and every result, and two more processes on the cores.
    Each daemon gets a socket, a shared-segment name and ephemeral ports of its
    own in a directory of this run; ``close`` stops the daemons started here,
    by pid, and removes that directory.
    """

    name = "sidecar"

    def __init__(self, layout: dict[str, Any], num_pages: int, *, loop: str = "uvloop", name: str = "sidecar",
                 path_first: Path | None = None) -> None:
        """``path_first``: as ``KvService``'s, for the daemons and the workers alike."""
        self.name, self.path_first = name, path_first
        self.layout, self.num_pages, self.loop = layout, num_pages, loop
        self.cfg: dict[str, Any] = {"layout": layout, "num_pages": num_pages, "loop": loop}
        self.send: Endpoint | None = None
        self.recv: Endpoint | None = None
        self.daemons: list[LocalDaemon] = []
        self.workdir: str | None = None

    def unavailable(self) -> str | None:
        """Why the sidecar cannot be measured on this host, or ``None``.  Its two
        daemons keep their pools in shared memory, which a container may not
        have room for (Docker's default /dev/shm is 64 MiB)."""
        need = 2 * KVLayout(num_pages=self.num_pages, **self.layout).pool_bytes
        try:
            st = os.statvfs(SHM_DIR)
        except OSError:
            return f"no {SHM_DIR} on this host for the daemons' shared pools"
        if st.f_bavail * st.f_frsize < need:
            return (f"{SHM_DIR} has {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free; the two daemons' "
                    f"pools need {need / 2**20:.0f} MiB")
        return None

    def start(self) -> None:
        tag = f"{NAME_PREFIX}{os.getpid()}-"  # this run's names (and a test's way to find leftovers)
        self.workdir = short_tmpdir(tag)
        layout = {**self.layout, "num_pages": self.num_pages}
        env = {**{k: v for k, v in CHILD_ENV.items() if v is not None}, "KVSERVICE_SIDECAR_LOOP": self.loop,
               "KVSERVICE_SERVICE_DRAIN_GRACE_S": "1"}  # as kv_side.make_config
        if self.path_first is not None:  # the daemons' kvservice is that one (and not the working directory's)
            env.update(PYTHONPATH=str(self.path_first), PYTHONSAFEPATH="1")
        self.daemons = [LocalDaemon(role, self.workdir, shm=f"{tag}{role}-{uuid.uuid4().hex[:8]}", layout=layout,
                                    env=env, stderr=_lines.child_stderr)
                        for role in ("prefill", "decode")]
        try:
            for d in self.daemons:  # both start at once
                d.spawn()
            prefill, decode = (d.await_ready(SETUP_TIMEOUT_S) for d in self.daemons)
        except DaemonError as exc:
            raise ChildError(str(exc)) from exc
        self.address = prefill.address
        self.send = Child("kvservice.bench.sidecar_side", "send", {**self.cfg, "socket": prefill.socket},
                          path_first=self.path_first)
        self.recv = Child("kvservice.bench.sidecar_side", "recv", {**self.cfg, "socket": decode.socket},
                          path_first=self.path_first)
        self.send.wait("ready", SETUP_TIMEOUT_S)
        self.recv.wait("ready", SETUP_TIMEOUT_S)

    def close(self) -> None:
        super().close()  # the workers first: they leave before their daemons do
        for d in self.daemons:
            d.signal(signal.SIGTERM)  # both drain at once
        for d in self.daemons:
            d.stop(timeout=30)
            d.cleanup_names()
        self.daemons = []
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


#: UCX restricted to TCP (loopback included): NIXL over the transport Mooncake runs here
TCP_ENV: dict[str, str | None] = {"UCX_TLS": "tcp"}


class Mooncake(_TwoChildren):
    """Mooncake's Transfer Engine in two child processes (``kvservice.bench.mooncake_side``).

    Its rows are labelled by the transport that ran (``mooncake/tcp``).  The receiver is
    the passive target of one-sided WRITEs: a request has arrived when the sender's batch
    for it completed (the module's docstring says why and what that favours)."""

    def __init__(self, layout: dict[str, Any], num_pages: int) -> None:
        self.name = f"mooncake/{mooncake_side.PROTOCOL}"
        self._cfg: dict[str, Any] = {"layout": layout, "num_pages": num_pages}
        self.send: Endpoint | None = None
        self.recv: Endpoint | None = None

    @staticmethod
    def unavailable() -> str | None:
        """Why Mooncake cannot be measured here (its package is an optional extra), or ``None``."""
        return mooncake_side.available()

    def start(self) -> None:
        env = mooncake_side.ENV
        self.send = Child("kvservice.bench.mooncake_side", "send", self._cfg, env=env)
        self.recv = Child("kvservice.bench.mooncake_side", "recv", self._cfg, env=env)
        self.send.wait("ready", SETUP_TIMEOUT_S)
        hr = self.recv.wait("ready", SETUP_TIMEOUT_S)
        self.send.call("connect", "connected", target=hr["target"], base=hr["base"], num_pages=hr["num_pages"])

    def measure(self, case: Case, prefix: str) -> dict[str, Any]:
        assert self.send is not None
        reqs = case.with_prefix(prefix)
        sample = self.send.call("run", "done", RUN_TIMEOUT_S, requests=reqs, concurrency=case.concurrency)
        return _two_sided(sample, {"last": sample["end"]}, len(reqs))
