"""Shared test helpers: configs and real peer processes.

Services are entered inside test bodies (not in fixtures), so no task group
or cancel scope is held across a pytest-asyncio fixture's ``yield``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import os
import random
import socket
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from kvservice import KVLayout, ServiceConfig, testing
from kvservice.memory import KVPool
from kvservice.memory._regions import regions_table
from kvservice.memory.engines import pool_regions
from kvservice.testing.inspect import inside

#: the environment variable carrying this run's ``slowdown()`` to its workers and children
SLOWDOWN_ENV = "KVSERVICE_TEST_SLOWDOWN"


def measure_slowdown(workers: int = 1) -> float:
    """How many times slower than one idle core per process this machine runs now: the
    runnable processes (the 1-minute load average, plus this run's ``workers``) per CPU,
    at least 1 and at most 10.  Measured once per run (``tests/conftest.py``)."""
    runnable = os.getloadavg()[0] + workers
    return min(10.0, max(1.0, runnable / (os.cpu_count() or 1)))


@functools.cache
def slowdown() -> float:
    """This run's factor: ``KVSERVICE_TEST_SLOWDOWN`` when set (``tests/conftest.py`` sets it
    once per run, before any worker starts), else measured now, once."""
    given = os.environ.get(SLOWDOWN_ENV)
    if not given:
        given = os.environ[SLOWDOWN_ENV] = f"{measure_slowdown():.2f}"  # every later reader agrees
    return float(given)


def scaled(seconds: float) -> float:
    """``seconds`` as long as this run's machine needs: for the few short timeouts a
    legitimate but merely slow peer must meet (a 1 s ``peer_timeout_s``, a handshake's
    ``connect_timeout_s``), so that a loaded machine does not fail what an idle one passes.
    A bound on how long a test waits for a condition needs no scaling: make it generous."""
    return seconds * slowdown()


LOOPBACK_UCX = {"UCX_NET_DEVICES": "lo"}
SMALL = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16", num_pages=64)


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` now (read from ``/proc``: each one's parent)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue  # ended meanwhile
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [child for child, ppid in parents.items() if ppid == parent]
        found += kids
        todo += kids
    return found


#: what engines' processes leave under /dev/shm when a test kills them (a process group's SIGKILL
#: takes multiprocessing's resource tracker and SGLang's own unlinking with it, and SGLang's load
#: snapshot file is not unlinked even on a clean stop): multiprocessing's named semaphores,
#: SGLang's load snapshots (``sglang/srt/managers/load_snapshot.py``), a new name per server
ENGINE_SHM_PREFIXES = ("sem.mp-", "sglang_loads_")


def shm_names(directory: str = "/dev/shm") -> set[str]:
    """The names in ``directory`` now (none when it does not exist)."""
    try:
        return set(os.listdir(directory))
    except FileNotFoundError:
        return set()


def held_files(directory: str) -> set[str]:
    """Names in ``directory`` that a live process maps or holds open (read from ``/proc``,
    every process that can be read: as root, all of them)."""
    prefix = os.path.join(os.path.realpath(directory), "")
    held: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as maps:
                for line in maps:
                    path = line.rstrip("\n").split(maxsplit=5)[5:]
                    if path and path[0].startswith(prefix):
                        held.add(path[0][len(prefix):].removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target.startswith(prefix):
                    held.add(target[len(prefix):])
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return held


def sweep_shm(before: set[str], directory: str = "/dev/shm",
              prefixes: tuple[str, ...] = ENGINE_SHM_PREFIXES) -> list[str]:
    """Unlink what a test run left in ``directory``: the names with one of ``prefixes`` that
    were not there ``before`` and that no live process maps or holds open (a server still
    running, this run's or another's, keeps its files).  Returns the names unlinked."""
    left = sorted(n for n in shm_names(directory) - before if n.startswith(prefixes))
    if not left:
        return []
    held = held_files(directory)
    swept = []
    for name in left:
        if name in held:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
            swept.append(name)
    return swept


def register_pool(door: Any, pool: KVPool) -> None:
    """Register ``pool`` with a door the way a service does (every page of every region)."""
    m = pool.memory
    door.register(m.segments, m.mem_type, regions_table(m.regions, m.num_pages))


def pool_table(layout: KVLayout, base: int) -> npt.NDArray[np.uint64]:
    """The descriptor table of a pool of ``layout`` at ``base`` (what its service prepares)."""
    return regions_table(pool_regions(layout, base), layout.num_pages)


def plane_indices(layout: KVLayout, pages: Sequence[int] | npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    """Descriptor indices of ``pages`` in a pool's table, written out independently of the
    service's code: entry ``plane * num_pages + page``, plane-major (plane = layer * 2 + K/V)."""
    planes = np.arange(2 * layout.layers, dtype=np.int32)[:, None] * layout.num_pages
    return (planes + np.asarray(pages, dtype=np.int32)[None, :]).ravel()


#: the ports ``free_port`` hands out: below the kernel's ephemeral range (32768-60999 by
#: default), so no socket bound to port 0 and no outgoing connection takes one meanwhile
_PORTS = range(20000, 32000)
#: one file per port handed out, made exclusively: no two tests (another xdist worker's,
#: another checkout's run) are given the same port while the first may still use it
_PORTS_GIVEN = Path(tempfile.gettempdir()) / "kvservice-test-ports"
#: a port given longer ago than this may be given again (longer than any test's timeout)
_PORT_HELD_S = 1800.0


def _claim(port: int) -> bool:
    mark = _PORTS_GIVEN / str(port)
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        pass
    try:
        if time.time() - mark.stat().st_mtime < _PORT_HELD_S:
            return False
        # stale: whoever renames it away first may claim it again
        mark.rename(mark.with_name(f"{port}.stale-{os.getpid()}"))
    except FileNotFoundError:
        return False
    mark.with_name(f"{port}.stale-{os.getpid()}").unlink()
    return _claim(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` nobody listens on now and no other test was given lately (for a
    service that must restart on it, an address nobody answers at, a server's ports chosen
    before it starts): safe with tests running in parallel, in this run or another."""
    _PORTS_GIVEN.mkdir(exist_ok=True)
    pick = random.Random()  # its own stream: a test's seeding of `random` does not pick ports
    for _ in range(200):
        port = pick.choice(_PORTS)
        if not _claim(port):
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # in use by something that did not ask us
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS} after 200 tries ({_PORTS_GIVEN})")


#: the defaults a legitimate but merely slow peer must meet (a heartbeat gap, a handshake):
#: ``config`` and ``peer_config`` scale them by this run's ``slowdown`` unless a test sets them
SCALED_DEFAULTS = ("peer_timeout_s", "connect_timeout_s")


def _test_defaults(kw: dict[str, Any]) -> dict[str, Any]:
    kw.setdefault("ucx_env", LOOPBACK_UCX)
    kw.setdefault("drain_grace_s", 1.0)
    defaults = {f.name: f.default for f in dataclasses.fields(ServiceConfig) if isinstance(f.default, int | float)}
    for name in SCALED_DEFAULTS:
        kw.setdefault(name, scaled(defaults[name]))
    return kw


def config(layout: KVLayout = SMALL, **kw: Any) -> ServiceConfig:
    """A service's config for a test: loopback, a short drain, the ``SCALED_DEFAULTS``."""
    return ServiceConfig(layout=layout, **_test_defaults(kw))


def peer_config(layout: KVLayout = SMALL, **kw: Any) -> dict[str, Any]:
    """A child service's config, with the defaults of ``config``."""
    return testing.peer_config(layout, **_test_defaults(kw))


#: a hang guard for a child service's start (Python, torch, its NIXL agent and vetting child
#: booting on a machine that may be busy with the rest of a parallel run): it costs nothing
#: when the child is ready sooner
READY_S = 120.0
#: start one child service per config; stop whatever is left on exit
peers = functools.partial(testing.peer_processes, ready_timeout=READY_S)


class Ticker:
    """Measures how late the event loop wakes a task that sleeps ``interval``."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.max_lag = 0.0
        self.ticks = 0

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await anyio.sleep(self.interval)
            self.max_lag = max(self.max_lag, time.perf_counter() - t0 - self.interval)
            self.ticks += 1


def _named(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what


async def eventually(pred: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0, interval: float = 0.005,
                     what: str | Callable[[], str] = "the condition") -> None:
    """Until ``pred()`` holds, asked every ``interval`` s for at most ``timeout`` s (state no
    event announces); then ``TimeoutError`` naming ``what``, a callable when the message should
    show the last state seen.  ``pred`` may be a coroutine function, for a state the test has to
    ask another process for."""
    with anyio.move_on_after(timeout):
        while True:
            held = pred()
            if inspect.isawaitable(held):
                held = await held
            if held:
                return
            await anyio.sleep(interval)
    raise TimeoutError(f"{_named(what)}: not within {timeout}s")


def members(svc: Any, check: Callable[[list[Any]], bool], role: str | None = None) -> Callable[[], Awaitable[bool]]:
    """A condition for ``eventually`` on ``svc``'s live members (``live_peers(role)``, a
    coroutine on either face): ``check`` of the list it answers."""
    async def held() -> bool:
        return check(await svc.live_peers(role))

    return held


def eventually_sync(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005,
                    what: str | Callable[[], str] = "the condition") -> None:
    """``eventually`` for code that runs without an event loop (a scheduler's thread, a
    fixture starting a server): the same bound, message and steps, sleeping the thread."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{_named(what)}: not within {timeout}s")
        time.sleep(interval)


@contextlib.contextmanager
def unclosed_resources() -> Iterator[list[str]]:
    """The ResourceWarnings (an anyio memory object stream, a socket, ... never closed) of
    objects collected inside the block, a collection forced at its end.  Under the suite's
    ``filterwarnings = error`` such a warning fails whichever later test happens to collect
    the object; here it is the block that names it."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield found
        gc.collect()
    found.extend(str(w.message) for w in caught if issubclass(w.category, ResourceWarning))


def heard_by(svc: Any) -> list[Any]:
    """Every control message ``svc``'s request plane hears from now on (each still handled
    as before): what a test's own service was told by the peer under test."""
    return inside(svc).heard()
