"""The two-host bench's control exchange against hostile and broken peers.

A real ``kvservice bench --listen`` process on loopback, keyed; this test plays
the other side on raw TCP.  Strangers (garbage, an oversized length, a wrong key,
no key) are refused with a reason and the listener goes on waiting; a driver that
authenticates and then sends a command that does not belong ends the session
with an ``Error`` frame naming the problem, and the listener exits with a clear
FAILED line.  No child process is started on the way: nothing was set up.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvservice._trust.keys import generate_key, load_key
from kvservice.bench import control

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    key = tmp_path / "cluster.key"
    generate_key(key)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvservice.cli", "bench", "--listen", "127.0.0.1:0", "--wait", "30",
         "--auth-key-file", str(key)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # "... listening on 127.0.0.1:PORT (authenticated) ..."
        assert "listening on 127.0.0.1:" in first and "(authenticated)" in first, first
        port = int(first.split("listening on 127.0.0.1:")[1].split()[0])
        yield proc, port, key
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)  # our own child, by pid
        with proc:  # closes its pipes
            proc.wait(timeout=30)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _refused(sock: socket.socket) -> bytes:
    """What the listener sends before it closes a refused connection."""
    data = b""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with our bytes unread
            return data
        if not chunk:
            return data
        data += chunk
    pytest.fail("the listener kept a refused connection open")


def _driver(port: int, key: bytes | None) -> control.Channel:
    chan = control.Channel(_connect(port), f"127.0.0.1:{port}")
    try:
        control.driver_handshake(chan, control.bench_key(key))
    except control.ControlError:
        chan.sock.close()
        raise
    return chan


def test_strangers_are_refused_and_a_bad_command_ends_the_session(
        listener: tuple[subprocess.Popen[str], int, Path]) -> None:
    proc, port, key_file = listener
    with _connect(port) as s:  # garbage
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        _refused(s)
    with _connect(port) as s:  # a length far past the pre-auth limit
        s.sendall(struct.pack(">I", 2**31) + b"x" * 64)
        _refused(s)
    with pytest.raises(control.ControlError, match="authentication failed"):  # a wrong key
        _driver(port, os.urandom(32))
    with pytest.raises(control.ControlError, match="this service has none"):  # no key at all
        _driver(port, None)
    assert proc.poll() is None, "a stranger ended the listener"

    chan = _driver(port, load_key(key_file))  # the real key: welcome
    chan.send(control.Clock(t=1.5))
    pong = chan.recv(control.ToDriver, time.monotonic() + 10)
    assert isinstance(pong, control.Clock) and pong.t == 1.5 and pong.now > 0
    # a command for a receiver that was never set up, with a page outside any pool
    chan.send(control.ToKv(cmd=control.KvExpect(
        requests=[control.KvRequest(rid="r", dst=[2**24 - 1])], sender="127.0.0.1:1")))
    with pytest.raises(control.ControlError, match="not set up"):
        chan.recv(control.ToDriver, time.monotonic() + 10)
    chan.sock.close()
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 1, err
    assert out.splitlines()[-1].startswith("kvservice bench --listen: FAILED: session with")
    assert err.count("refused 127.0.0.1:") == 4, err


def test_frames_are_bounded_and_typed() -> None:
    """Unit checks of the message types: what a listener refuses before it forwards anything."""
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"op":"to_raw","cmd":{"op":"connect","metadata":"x","base":-1,"num_pages":4}}',
                            type=control.ToListener)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"op":"setup","plan":"huge","methods":["raw_nixl"]}', type=control.ToListener)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"op":"to_kv","cmd":{"op":"expect","requests":[{"rid":"a","dst":[]}],'
                            b'"sender":"h:1"}}', type=control.ToListener)
    with pytest.raises(msgspec.ValidationError):  # a relay from a child the driver never asked for
        msgspec.json.decode(b'{"op":"relay","source":"shell","msg":{}}', type=control.ToDriver)
