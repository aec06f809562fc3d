"""The NIXL door against a real remote agent in another process.

These pin down the NIXL behaviour kvservice relies on (see docs/design.md): a
post to a dead peer raises ``nixlRemoteDisconnectError``; the door turns it
into a ``DoorError`` carrying that very instance and leaves no handle behind;
a handle is never touched after its release; a peer can be reloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvservice import FailureReason
from kvservice._nixl.agent import NixlDoor
from kvservice._nixl.door import DoorError, XferState
from kvservice.memory._pool import KVPool
from kvservice.soak._usage import established, usage
from tests.helpers import LOOPBACK_UCX, SMALL, plane_indices, pool_table, register_pool

pytestmark = pytest.mark.nixl


def _start_child() -> tuple[subprocess.Popen[str], bytes, np.ndarray]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.system.door_child"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    return proc, bytes.fromhex(info["metadata"]), pool_table(SMALL, info["base"])


def _wait_done(door: NixlDoor, xid: int, state: XferState) -> XferState:
    deadline = time.monotonic() + 10  # hang guard only: a healthy 4-page WRITE takes microseconds
    while state is XferState.PROC and time.monotonic() < deadline:
        state = door.check(xid)
    return state


def _reap(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=10)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


@pytest.fixture
def door() -> NixlDoor:
    d = NixlDoor("door-test", progress_thread=True, ucx_env=LOOPBACK_UCX)
    pool = KVPool(SMALL)
    register_pool(d, pool)
    d._test_pool = pool  # type: ignore[attr-defined]  # keep the registered tensor alive
    yield d
    d.close()


def test_post_to_dead_peer_raises_remote_disconnect_and_leaves_nothing(door: NixlDoor) -> None:
    proc, metadata, table = _start_child()
    try:
        door.add_peer("door-child", metadata, table)
        idx = plane_indices(SMALL, SMALL.check_pages([1, 2, 3]))
        xid, state = door.post("door-child", idx, idx, b"")
        assert _wait_done(door, xid, state) is XferState.DONE
        assert door.check(xid) is XferState.GONE  # released on DONE; answered from the table
        assert door.release(xid) is False  # a second release never reaches NIXL
    finally:
        _reap(proc)
    with pytest.raises(DoorError) as info:
        for _ in range(50):  # the first post after the death may still be accepted by UCX
            xid, state = door.post("door-child", idx, idx, b"")
            _wait_done(door, xid, state)
    err = info.value
    assert err.reason is FailureReason.REMOTE_DISCONNECT
    assert type(err.original).__name__ == "nixlRemoteDisconnectError"
    assert err.__cause__ is err.original
    assert door.live_xfers() == 0


def test_restarted_peer_is_reloaded_under_the_same_name(door: NixlDoor) -> None:
    idx = plane_indices(SMALL, SMALL.check_pages([5]))
    for _ in range(2):
        proc, metadata, table = _start_child()
        try:
            door.add_peer("door-child", metadata, table)  # replaces the dead incarnation
            xid, state = door.post("door-child", idx, idx, b"")
            assert _wait_done(door, xid, state) is XferState.DONE
        finally:
            _reap(proc)
    assert door.remove_peer("door-child") == []
    assert door.live_xfers() == 0


def test_garbage_metadata_is_a_door_error(door: NixlDoor) -> None:
    assert door.metadata_agent(b"not nixl metadata") is None
    with pytest.raises(DoorError) as info:
        door.add_peer("nobody", b"not nixl metadata", pool_table(SMALL, 1 << 20))
    assert info.value.reason is FailureReason.INCOMPATIBLE
    assert door.remove_peer("nobody") == []


def test_metadata_naming_another_agent_is_refused_before_loading(door: NixlDoor) -> None:
    """A peer cannot hand us NIXL metadata of another agent (a live peer, say): the
    name inside is read first, and nothing is loaded, replaced or removed."""
    proc, metadata, table = _start_child()
    try:
        assert door.metadata_agent(metadata) == "door-child"
        assert door.metadata_agent(metadata[:20]) is None  # truncated
        with pytest.raises(DoorError, match="names agent 'door-child'") as info:
            door.add_peer("impostor", metadata, table)
        assert info.value.reason is FailureReason.INCOMPATIBLE
        door.add_peer("door-child", metadata, table)  # the genuine claim loads
        idx = plane_indices(SMALL, SMALL.check_pages([7]))
        xid, state = door.post("door-child", idx, idx, b"")
        assert _wait_done(door, xid, state) is XferState.DONE
        with pytest.raises(DoorError):  # and a second impostor does not unload it
            door.add_peer("other", metadata, table)
        xid, state = door.post("door-child", idx, idx, b"")
        assert _wait_done(door, xid, state) is XferState.DONE
    finally:
        _reap(proc)


def _tcp_of(*pids: int) -> int:
    """Established TCP connections held by ``pids`` (this namespace)."""
    tcp = established()
    return sum(int(usage(pid, tcp)["tcp"]) for pid in pids)


def test_a_live_peer_loaded_again_reuses_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """A link lost while the peer lives, then made again: the door kept the peer loaded
    (``keep_loaded``) and loading it again with the same metadata opens no connection.
    Without that, NIXL 1.5's ``remove_remote_agent`` leaves the UCX connection to the live
    peer open: each reload adds one on each side (what a soak with network cuts saw grow
    by hundreds an hour).  If a NIXL release closes them, the second half says so."""
    tcp_ucx = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    monkeypatch.setenv("UCX_TLS", "tcp")  # the child's too
    d = NixlDoor("door-tcp", progress_thread=True, ucx_env=tcp_ucx)
    pool = KVPool(SMALL)
    register_pool(d, pool)
    proc, metadata, table = _start_child()
    idx = plane_indices(SMALL, SMALL.check_pages([1, 2]))
    try:
        kept = []
        for _ in range(4):
            d.add_peer("door-child", metadata, table)
            xid, state = d.post("door-child", idx, idx, b"")
            assert _wait_done(d, xid, state) is XferState.DONE
            assert d.remove_peer("door-child", keep_loaded=True) == []
            kept.append(_tcp_of(os.getpid(), proc.pid))
        assert kept[0] >= 1 and kept == [kept[0]] * 4, kept
        assert d.kept_agents == 1
        reloaded = []
        d.forget_peer("door-child")
        for _ in range(3):
            d.add_peer("door-child", metadata, table)
            xid, state = d.post("door-child", idx, idx, b"")
            assert _wait_done(d, xid, state) is XferState.DONE
            d.remove_peer("door-child")
            reloaded.append(_tcp_of(os.getpid(), proc.pid))
        assert reloaded[-1] > reloaded[0], f"NIXL closed the connections of a removed agent: {reloaded}"
        assert d.kept_agents == 0 and d.live_xfers() == 0
    finally:
        _reap(proc)
        d.close()
