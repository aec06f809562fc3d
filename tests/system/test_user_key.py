"""Without ``auth_key_file`` a service on loopback authenticates with its user's own key.

Real NIXL, real processes.  A decode of another user (``nobody``, with a home of its
own, so a key of its own) expects the ids a prefill sends and gets ``REFUSED`` and no
byte; a decode of the same user, configured with nothing, links and gets them
byte-exact.  ``allow_unauthenticated`` on both sides links without a key, and a keyless
and a keyed service still refuse each other.  The process environment is the suite's
own (``HOME``, ``XDG_*``): these tests use the key the rest of the suite uses.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

import kvservice
from kvservice import FailureReason, TransferService
from kvservice._trust.keys import user_key_dir
from kvservice.testing import PeerProcess, pattern

from ..helpers import READY_S, SMALL, config, peer_config, peers

pytestmark = pytest.mark.nixl

NOBODY = 65534
PAGES = [10, 11, 12, 13]


def svc_config(**kw: Any) -> Any:
    kw.setdefault("connect_timeout_s", 2.0)
    return config(**kw)


def other_users_python() -> str:
    """This environment's interpreter by a path another user can walk: NIXL loads its
    plugins from the environment after the decode dropped to that user.  An environment
    that is a link out of the checkout is reached at its target; one inside an unreadable
    checkout cannot be, and the test says so."""
    prefix = os.path.realpath(sys.prefix)
    closed = [d for d in [prefix, *Path(prefix).parents] if not os.stat(d).st_mode & stat.S_IXOTH]
    if closed:
        pytest.skip(f"the Python environment {prefix} is not reachable by another user ({closed[0]} is closed)")
    return os.path.join(prefix, "bin", os.path.basename(sys.executable))


@asynccontextmanager
async def decode_as(uid: int, cfg: dict[str, Any]) -> AsyncIterator[PeerProcess]:
    """A decode process run by ``uid``, with a home of its own (its own per-user key).

    The checkout may be unreadable to ``uid`` (a clone in a 0700 folder), and the decode
    imports parts of kvservice after it dropped to ``uid``: it runs a copy of this very
    package, made for it in a folder it owns (``-P``: not the checkout in the working
    directory, which comes first on ``sys.path`` otherwise)."""
    home = tempfile.mkdtemp(prefix="kvs-home-")
    code = tempfile.mkdtemp(prefix="kvs-code-")
    package = os.path.dirname(kvservice.__file__)
    shutil.copytree(package, os.path.join(code, "kvservice"), ignore=shutil.ignore_patterns("__pycache__"))
    for path in [home, code, *(os.path.join(d, n) for d, ds, fs in os.walk(code) for n in ds + fs)]:
        os.chown(path, uid, uid)
    checkout = os.path.dirname(package)  # for the launcher, which runs before the drop
    launcher = (other_users_python(), "-P", "-m", "tests.system.as_user", str(uid), home)
    env = {"PYTHONPATH": os.pathsep.join([code, checkout, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        async with anyio.create_task_group() as tg:
            proc = await PeerProcess.start(tg, cfg, prefix=launcher, env=env, ready_timeout=READY_S)
            try:
                yield proc
            finally:
                with anyio.CancelScope(shield=True):
                    await proc.stop(timeout=5)
                tg.cancel_scope.cancel()
        assert await anyio.Path(user_key_dir({"HOME": home}), "key").exists(), "it made no key of its own"
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(code, ignore_errors=True)


async def refused_and_untouched(decode: PeerProcess, svc: TransferService, rid: str) -> None:
    """``decode`` expects ``rid`` from ``svc``: refused for authentication, its pages stay zero."""
    await decode.command(op="expect", rid=rid, pages=PAGES, sender=svc.address)
    arrived = await decode.event("arrived", rid)
    assert arrived["status"] == "FAILED" and arrived["reason"] == FailureReason.REFUSED.value, arrived
    assert "authenticat" in arrived["message"] or "key" in arrived["message"], arrived
    await decode.command(op="untouched", pages=PAGES)
    assert (await decode.event("untouched"))["ok"] is True


async def transfer(svc: TransferService, decode: PeerProcess, rid: str) -> None:
    """One request from ``svc`` to ``decode``, verified byte for byte there."""
    svc.kv.write(PAGES, pattern(SMALL, rid, len(PAGES)))
    await decode.command(op="expect", rid=rid, pages=PAGES, sender=svc.address)
    await decode.event("expecting", rid)
    result = await svc.await_completion(await svc.send(rid, PAGES, last=True), timeout=15)
    assert result.ok, result
    arrived = await decode.event("arrived", rid)
    assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the other user is nobody (uid 65534)")
async def test_another_users_decode_cannot_link() -> None:
    """Both configured with nothing: the other user's key is not ours, so its expect of the
    very id we send is refused (counted ``auth``) and gets no byte; our send times out at
    bootstrap and the service stays up for a decode of its own user."""
    cfg = svc_config(bootstrap_timeout_s=2.0)
    async with TransferService(cfg) as svc, decode_as(NOBODY, peer_config()) as thief:
        svc.kv.write(PAGES, pattern(SMALL, "secret-a", len(PAGES)))
        handle = await svc.send("secret-a", PAGES, last=True)
        await refused_and_untouched(thief, svc, "secret-a")  # before this change: SUCCESS, verified
        result = await svc.await_completion(handle, timeout=15)
        assert not result.ok and result.reason is FailureReason.TIMEOUT, result
        assert svc.status()["peers"] == []
        assert svc.status()["refused"].get("auth", 0) >= 1
        await thief.command(op="untouched", pages=PAGES)
        assert (await thief.event("untouched"))["ok"] is True
        async with peers(peer_config()) as (ours,):
            await transfer(svc, ours, "secret-b")


async def test_the_same_users_processes_link_with_no_configuration() -> None:
    """A service and a decode process, neither told of a key, authenticate with the user's key."""
    with capture_logs() as logs:
        async with TransferService(svc_config()) as svc, peers(peer_config()) as (decode,):
            await transfer(svc, decode, "mine-1")
    key_lines = [e for e in logs if e["event"] == "service.key"]
    assert len(key_lines) == 1 and key_lines[0]["source"] == "user", key_lines
    assert key_lines[0]["path"] == os.path.join(user_key_dir(os.environ), "key")
    assert all(e.get("authenticated") is True for e in logs if e["event"] == "peer.connected")
    assert not [e for e in logs if e["event"] == "service.unauthenticated"]


async def test_allow_unauthenticated_on_both_sides_links_without_a_key() -> None:
    with capture_logs() as logs:
        async with (TransferService(svc_config(allow_unauthenticated=True)) as svc,
                    peers(peer_config(allow_unauthenticated=True)) as (decode,)):
            await transfer(svc, decode, "open-1")
    assert [(e["source"], e["path"]) for e in logs if e["event"] == "service.key"] == [("none", None)]
    assert [e for e in logs if e["event"] == "service.unauthenticated"]
    assert all(e.get("authenticated") is False for e in logs if e["event"] == "peer.connected")


@pytest.mark.parametrize("keyless", ["prefill", "decode"])
async def test_keyless_and_keyed_refuse_each_other(keyless: str) -> None:
    cfg = svc_config(allow_unauthenticated=keyless == "prefill")
    async with (TransferService(cfg) as svc,
                peers(peer_config(allow_unauthenticated=keyless == "decode")) as (decode,)):
        await refused_and_untouched(decode, svc, "mixed-1")
        assert svc.status()["refused"].get("auth", 0) >= 1
        assert svc.status()["peers"] == []
