"""Who is at the other end of the workers' socket, on both ends.

The daemon refuses a worker whose uid is neither its own nor listed in
``sidecar.allowed_uids`` (the kernel says who connects: ``SO_PEERCRED``), and a
listed one works end to end through ``sidecar.group``.  The client refuses a
daemon run by another user (a planted socket) and checks what a daemon announces
before mapping it.  A daemon does not start over another user's socket or
segment.  The other user is ``nobody``, so most of this needs root.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.abc
import pytest
import torch

from kvservice import KVLayout, KVServiceError, SidecarClient
from kvservice.sidecar.shm import segment_path
from kvservice.sidecar.wire import SIDECAR_PROTOCOL_VERSION, StatusReply, Welcome, encode
from kvservice.testing import pattern

from .daemons import REPO, SMALL_LAYOUT, Sidecar, metrics, short_tmpdir

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the other user is nobody (uid 65534)")


@contextlib.contextmanager
def foreign(mode: str, *args: str) -> Iterator[IO[bytes]]:
    """``tests.sidecar.foreign`` as nobody; yields its stdout (JSON lines); killed on exit."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.sidecar.foreign", str(NOBODY), mode, *args],
                            stdout=subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None
    try:
        yield proc.stdout
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()


async def said(out: IO[bytes], timeout: float = 60.0) -> dict[str, Any]:
    """The foreign process's next line (it is killed, ending the read, if this times out)."""
    with anyio.fail_after(timeout):
        line = await anyio.to_thread.run_sync(out.readline, abandon_on_cancel=True)
    assert line, "the foreign process exited without a word"
    result: dict[str, Any] = json.loads(line)
    return result


# -- the daemon checks the worker ---------------------------------------------------------------


@as_root
@pytest.mark.nixl
async def test_a_worker_of_another_uid_is_refused_unless_allowed() -> None:
    workdir = short_tmpdir()
    os.chmod(workdir, 0o711)  # nobody may reach the sockets; the sockets' own modes decide the rest
    shared = {"KVSERVICE_SIDECAR_GROUP": "nogroup"}
    prefill = Sidecar("prefill", workdir, env=shared)  # nobody can connect (group), but is not allowed
    decode = Sidecar("decode", workdir, env={**shared, "KVSERVICE_SIDECAR_ALLOWED_UIDS": str(NOBODY)})
    try:
        prefill.spawn()
        decode.spawn()
        prefill.await_ready()
        decode.await_ready()
        for path in (prefill.socket, segment_path(prefill.shm), decode.socket, segment_path(decode.shm)):
            st = os.stat(path)
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, 0, NOBODY), path

        with foreign("worker", prefill.socket) as out:
            reply = await said(out)
        assert f"uid {NOBODY} may not use this sidecar (allowed: the daemon's own uid 0 and " \
               "sidecar.allowed_uids)" in reply["refused"], reply
        refused = [e for e in prefill.events("sidecar.client_refused") if e["kind"] == "uid"]
        assert len(refused) == 1 and refused[0]["uid"] == NOBODY
        assert (await metrics(prefill.http))['kvservice_refused_total{where="workers",kind="uid"}'] == 1

        async with SidecarClient(prefill.socket) as pw:  # the daemon's own uid: served
            rid, src, dst = "foreign", [3, 4], [5, 6]
            pw.kv.write(src, pattern(pw.layout, rid, 2))
            with foreign("receive", decode.socket, pw.address, rid, *map(str, dst)) as out:
                assert await said(out) == {"expecting": rid}  # nobody is listed on the decode side
                assert (await pw.await_completion(await pw.send(rid, src, last=True), timeout=30)).ok
                assert await said(out) == {"arrived": True, "exact": True, "message": ""}
        decode_metrics = await metrics(decode.http)
        assert decode_metrics.get('kvservice_refused_total{where="workers",kind="uid"}', 0) == 0
        assert decode_metrics['kvservice_transfers_total{side="recv",status="SUCCESS",reason=""}'] == 1
        for d in (prefill, decode):
            assert d.proc is not None and d.proc.poll() is None
    finally:
        for d in (prefill, decode):
            d.stop()
            d.cleanup_names()
        shutil.rmtree(workdir, ignore_errors=True)


# -- the client checks the daemon ---------------------------------------------------------------


@as_root
async def test_the_client_refuses_a_socket_planted_by_another_user() -> None:
    workdir = short_tmpdir()
    os.chmod(workdir, 0o777)
    path = os.path.join(workdir, "kvservice.sock")
    try:
        with foreign("plant", path) as out:
            assert await said(out) == {"listening": NOBODY}
            with pytest.raises(KVServiceError) as info:
                async with SidecarClient(path, connect_timeout=10):
                    pass
            assert f"runs as uid {NOBODY}, not as this user (0) or root: refusing to talk to it" in str(info.value)
            assert await said(out) == {"received": 0}  # not even a Hello went to it
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.asynccontextmanager
async def fake_daemon(path: str, announce: dict[str, Any]) -> AsyncIterator[None]:
    """A listener that answers every Hello with a Welcome made of ``announce`` (changeable)."""
    async def greet(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                await stream.receive()  # the Hello
                await stream.send(encode(Welcome(**announce)))
                await stream.receive()  # a client that accepted the Welcome asks for the status
                await stream.send(encode(StatusReply(1, {})))
                await stream.receive()

    async with await anyio.create_unix_listener(path) as listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, greet)
        yield
        tg.cancel_scope.cancel()


async def test_the_client_checks_what_the_daemon_announces(tmp_path: Path) -> None:
    workdir = short_tmpdir()
    path = os.path.join(workdir, "fake.sock")
    name = f"kvs-test-{uuid.uuid4().hex[:10]}"
    target = tmp_path / "pool"
    layout = dict(SMALL_LAYOUT)
    announce: dict[str, Any] = {
        "version": SIDECAR_PROTOCOL_VERSION, "pid": 1, "agent": "fake", "address": "127.0.0.1:1",
        "roles": ["prefill"], "shm_name": name, "layout": layout, "max_frame_bytes": 1 << 20, "results_kept": 10}

    async def refused(match: str, **change: Any) -> None:
        announce.update(change)
        with pytest.raises(KVServiceError, match=match):
            async with SidecarClient(path, connect_timeout=10):
                pass

    try:
        async with fake_daemon(path, announce):
            for bad in ("../../etc/passwd", "a/b", "", ".hidden", "-x", "x" * 201, "kvs\x00x", "kvs x"):
                await refused("announced an invalid shared-memory name", shm_name=bad)
            await refused("announced an invalid layout", shm_name=name, layout={**layout, "num_pages": -1})
            await refused("announced an invalid layout", layout={**layout, "bogus": 1})
            announce["layout"] = layout
            await refused(r"cannot map the sidecar's KV pool: .*cannot open /dev/shm/kvs-test-")  # none there
            target.write_bytes(b"\0" * KVLayout(**layout).pool_bytes)
            os.symlink(target, segment_path(name))  # a name that leads elsewhere
            await refused("Too many levels of symbolic links")
            os.unlink(segment_path(name))
            shutil.copy(target, segment_path(name))
            os.chmod(segment_path(name), 0o600)
            if os.geteuid() == 0:
                os.chown(segment_path(name), NOBODY, -1)  # another user's file under the right name
                await refused(f"belongs to uid {NOBODY}, not to the sidecar's \\(0\\)")
                os.chown(segment_path(name), 0, -1)
            async with SidecarClient(path, connect_timeout=10, status_interval=0) as ok:  # all in order: it maps
                ok.kv.write([1], torch.ones_like(ok.kv.pages([1])))
                assert ok.kv.tensor.shape[2] == SMALL_LAYOUT["num_pages"]
        assert target.read_bytes() == b"\0" * KVLayout(**layout).pool_bytes  # the copy was mapped, not this
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment_path(name))
        shutil.rmtree(workdir, ignore_errors=True)


# -- a daemon does not start over another user's names ----------------------------------------------


@as_root
def test_a_daemon_refuses_another_users_socket_or_segment() -> None:
    workdir = short_tmpdir()
    seg = Sidecar("prefill", workdir, name="their-shm")
    try:
        theirs = os.path.join(workdir, "theirs.sock")
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(theirs)  # left behind when closed, as by a crashed daemon
        os.chown(theirs, NOBODY, NOBODY)
        link = os.path.join(workdir, "link.sock")
        os.symlink(theirs, link)
        with open(segment_path(seg.shm), "wb") as f:
            f.write(b"\0" * 4096)
        os.chown(segment_path(seg.shm), NOBODY, NOBODY)
        cases = [
            (Sidecar("prefill", workdir, name="their-socket", env={"KVSERVICE_SIDECAR_SOCKET_PATH": theirs}),
             f"sidecar.socket_path {theirs} belongs to uid {NOBODY}, not to this user (0); remove it"),
            (Sidecar("prefill", workdir, name="linked", env={"KVSERVICE_SIDECAR_SOCKET_PATH": link}),
             f"sidecar.socket_path {link} exists and is not a socket"),
            (seg, f"shared memory: {segment_path(seg.shm)} exists and belongs to uid {NOBODY}, not to this user"),
        ]
        for d, _ in cases:
            d.spawn()
        for d, message in cases:
            code = d.wait(60)
            lines = d.stderr_lines()
            assert code == 1 and len(lines) == 1, d.log()
            assert lines[0].startswith("kvservice serve: cannot start: ") and message in lines[0], lines
        assert os.stat(theirs).st_uid == NOBODY and os.path.islink(link)  # nothing of theirs removed
        assert os.stat(segment_path(seg.shm)).st_uid == NOBODY
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment_path(seg.shm))
        shutil.rmtree(workdir, ignore_errors=True)
