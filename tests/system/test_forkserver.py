"""The fork server the test suite starts its peers from (``kvservice.testing.forkserver``):
each child is a process of its own (PID, parent, environment, directory, descriptors), its
exit code and the signal that killed it reach the parent, a stdin that ends ends it, and
nothing is left open; an environment the server cannot give a child is refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import anyio
import pytest

from kvservice.testing import PeerProcess
from kvservice.testing.forkserver import ForkedProcess, ForkServer, forkable
from kvservice.testing.peer_process import PEER_MODULE, use_fork_server

from ..helpers import READY_S, peer_config, unclosed_resources

ENTRY = "tests.system.fork_child:main"


async def _line(proc: ForkedProcess) -> dict[str, object]:
    assert proc.stdout is not None
    buf = b""
    with anyio.fail_after(30):
        while not buf.endswith(b"\n"):
            buf += await proc.stdout.receive()
    return json.loads(buf)


async def test_children_are_processes_of_their_own_with_their_own_environment() -> None:
    server = ForkServer.shared([PEER_MODULE])
    env = {**os.environ, "FORK_TEST_VALUE": "mine"}
    with unclosed_resources() as unclosed:
        a = await ForkedProcess.start(server, ENTRY, ["x", "echo"], env)
        b = await ForkedProcess.start(server, ENTRY, ["x", "echo"], {**env, "FORK_TEST_VALUE": "theirs"})
        assert a.stdin is not None and b.stdin is not None
        await a.stdin.send(b"hello\n")
        await b.stdin.send(b"there\n")
        got_a, got_b = await _line(a), await _line(b)
        assert got_a["pid"] == a.pid != b.pid == got_b["pid"] != os.getpid()
        assert got_a["ppid"] == got_b["ppid"] != os.getpid()  # the server's children
        assert (got_a["line"], got_a["env"], got_b["line"], got_b["env"]) == ("hello", "mine", "there", "theirs")
        assert got_a["cwd"] == os.getcwd() and got_a["torch"] is True  # forked with the imports done
        await a.stdin.aclose()  # stdin ends: the child ends
        with anyio.fail_after(30):
            assert await a.wait() == 0
        b.kill()
        with anyio.fail_after(30):
            assert await b.wait() == -signal.SIGKILL
        assert (a.returncode, b.returncode) == (0, -signal.SIGKILL)
        for p in (a, b):
            await p.aclose()
    assert unclosed == []


async def test_exit_codes_signals_and_errors_reach_the_parent() -> None:
    server = ForkServer.shared([PEER_MODULE])
    env = dict(os.environ)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        exits = await ForkedProcess.start(server, ENTRY, ["x", "exit", "7"], env)
        raises = await ForkedProcess.start(server, ENTRY, ["x", "raise"], env, devnull)
        stopped = await ForkedProcess.start(server, ENTRY, ["x", "sleep"], env)
    finally:
        os.close(devnull)
    with anyio.fail_after(30):
        assert await exits.wait() == 7
        assert await raises.wait() == 1
        await _line(stopped)
        stopped.send_signal(signal.SIGSTOP)
        stopped.terminate()  # pending while stopped
        stopped.send_signal(signal.SIGCONT)
        assert await stopped.wait() == -signal.SIGTERM
    stopped.kill()  # after its exit: nothing to signal, no error
    for p in (exits, raises, stopped):
        await p.aclose()


def test_an_environment_read_before_start_up_is_not_forkable() -> None:
    assert forkable(dict(os.environ))
    assert not forkable({**os.environ, "PYTHONPATH": "/elsewhere"})
    assert not forkable({**os.environ, "LD_PRELOAD": "libsomething.so"})
    assert forkable({**os.environ, "UCX_TLS": "tcp"})  # read by UCX later, in the child


async def test_a_peer_with_another_python_path_is_started_the_ordinary_way() -> None:
    before = use_fork_server(True)
    try:
        await _one_of_each()
    finally:
        use_fork_server(before)


async def _one_of_each() -> None:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    async with anyio.create_task_group() as tg:
        peer = await PeerProcess.start(tg, peer_config(), env=env, ready_timeout=READY_S)
        try:
            assert not isinstance(peer.proc, ForkedProcess)
        finally:
            assert await peer.stop() == 0
        forked = await PeerProcess.start(tg, peer_config(), ready_timeout=READY_S, stderr=subprocess.DEVNULL)
        try:
            assert isinstance(forked.proc, ForkedProcess)
        finally:
            assert await forked.stop() == 0


def test_a_sidecar_daemon_is_forked_too_and_stops_as_one() -> None:
    from kvservice.sidecar.local import short_tmpdir
    from kvservice.testing.forkserver import ForkedPopen
    from tests.sidecar.daemons import Sidecar

    before = use_fork_server(True)
    workdir = short_tmpdir()
    daemon = Sidecar("prefill", workdir)
    try:
        daemon.start(timeout=READY_S)
        assert isinstance(daemon.proc, ForkedPopen)
        assert daemon.ready["address"] and os.path.exists(daemon.socket)
        assert daemon.stop() == 0  # SIGTERM: it drains and removes its names
        assert daemon.names_gone()
    finally:
        use_fork_server(before)
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.kill()
        daemon.cleanup_names()
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_signal_to_a_child_its_server_reaped_unannounced_is_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server reaps a child at a moment of its own and tells the parent after: a daemon
    stopped in between (here, the server's word held back) is gone, not an error, and the
    signal goes to no other process that may have its pid by then."""
    from kvservice.sidecar.local import LocalDaemon, short_tmpdir
    from kvservice.testing.forkserver import ForkedPopen

    server = ForkServer.shared([PEER_MODULE])
    child = ForkedPopen(server, ENTRY, ["x", "sleep"], dict(os.environ))
    assert child.stdout is not None
    assert child.stdout.readline() == b"{}\n"
    os.kill(child.pid, signal.SIGKILL)
    assert server.wait_exit(child.pid, 30) == -signal.SIGKILL  # reaped by its server
    monkeypatch.setattr(server, "exit_code", lambda pid: None)  # ... its word not here yet
    workdir = short_tmpdir()
    try:
        daemon = LocalDaemon("prefill", workdir)
        daemon.proc = child
        daemon.signal(signal.SIGTERM)  # no ProcessLookupError
        child.send_signal(signal.SIGKILL)
        monkeypatch.undo()
        assert daemon.wait(5) == -signal.SIGKILL
        assert child._pidfd.fd == -1  # closed once its exit is known
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
