"""A member's certificate rotated while it runs (docs/security.md "Rotation").

Decode-0 (this process) is linked to prefill-0 (a real process), both with member
identities, requests flowing from prefill into decode, when decode-0's files are issued
again (``kvservice keygen issue --force``: each replaced by a rename).  The new pair is put
in force for new handshakes, in both directions, without the link to prefill-0 being made
again and with every request byte-exact across it.  A pair that does not check out is
refused, counted once, and the old certificate keeps working; the expiry warning follows
the certificate in force.  Real NIXL agents, a real prefill process."""

from __future__ import annotations

import datetime as dt
import os
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from kvservice import TransferService
from kvservice._trust.authority import issue, serial_of
from kvservice._trust.rotation import ROTATION_REFUSED, IdentityWatch
from kvservice.testing import PeerProcess
from tests.faults.test_member_identity import WAIT_S, Authority, handshakes, legit, refused
from tests.helpers import config, eventually, peer_config, peers

pytestmark = [pytest.mark.nixl]

#: requests run while a rotation takes effect (a poll every 2 s): a bound, not an expectation
ROUNDS = 2000


@pytest.fixture
def cluster(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


def watch(svc: TransferService) -> IdentityWatch:
    found = handshakes(svc).identity_watch
    assert found is not None
    return found


def serial_in_force(svc: TransferService) -> int:
    """The serial of the certificate ``svc`` proves itself with in new handshakes."""
    identity = handshakes(svc)._identity
    assert identity is not None
    return identity.member.serial


def proven_serial(svc: TransferService, agent: str) -> int:
    """The serial of the certificate ``agent`` proved on its latest link to ``svc``."""
    member = handshakes(svc).members.get(agent)
    assert member is not None, agent
    return member.serial


def _replace(src: str, dst: str) -> None:
    """``dst`` replaced by a copy of ``src`` (its mode kept) with one rename."""
    shutil.copy2(src, dst + ".new")
    os.replace(dst + ".new", dst)


async def polls_pass(svc: TransferService, count: int = 3) -> None:
    """``count`` more polls of the trust files went by."""
    start = watch(svc).polls
    await eventually(lambda: watch(svc).polls >= start + count, WAIT_S, what=f"{count} polls")


async def linked_and_proven(dialler: TransferService, to: TransferService, rid: str) -> int:
    """``dialler`` links to ``to`` (its expect dials ``to``): the serial ``to`` proved to it."""
    await dialler.expect(rid, [1], sender=to.address)
    await eventually(lambda: to.address in dialler.status()["peers"], WAIT_S, what="linked")
    return proven_serial(dialler, to.agent_name)


async def traffic_until(prefill: PeerProcess, decode: TransferService, started: anyio.Event, done: anyio.Event,
                        tag: str) -> int:
    """Requests from prefill into decode, each byte-exact, until ``done`` and 3 more: how
    many.  ``started`` is set once the first has passed."""
    after = 0
    with anyio.fail_after(WAIT_S):  # a hang guard
        for n in range(ROUNDS):
            await legit(prefill, decode, f"{tag}-{n}")
            started.set()
            after += done.is_set()
            if after >= 3:
                return n + 1
    raise AssertionError(f"the rotation was not in force after {ROUNDS} requests")


async def test_rotation_keeps_links_and_new_links_present_the_new_certificate(cluster: Authority) -> None:
    """Decode-0's pair is issued again while prefill-0's requests flow into it: the new
    certificate is put in force without a refusal; prefill-0's link is the same link
    throughout (its generation unchanged, still one peer) and every request byte-exact; a
    member linking to decode-0 after, and one decode-0 dials, each see the new serial."""
    decode_files = cluster.member("decode-0", "decode")
    async with (peers(peer_config(**cluster.member("prefill-0"))) as (prefill,),
                TransferService(config(**decode_files)) as decode):
        await legit(prefill, decode, "before")
        assert decode._plane is not None
        generation = decode._plane.control.generation_of(prefill.agent)
        old = serial_in_force(decode)

        started, done = anyio.Event(), anyio.Event()

        async def rotate() -> None:
            await started.wait()
            cert, _ = issue(cluster.dir, "decode", "decode-0", cluster.dir, force=True)
            new = serial_of(cert)
            assert new != old
            await eventually(lambda: serial_in_force(decode) == new, WAIT_S, what="the new pair in force")
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(rotate)
            await traffic_until(prefill, decode, started, done, "during")

        new = serial_in_force(decode)
        assert refused(decode, ROTATION_REFUSED) == 0
        assert decode._plane.control.generation_of(prefill.agent) == generation
        assert decode.status()["peers"] == [prefill.address]
        async with TransferService(config(**cluster.member("decode-1", "decode"))) as other:
            assert await linked_and_proven(other, decode, "to-decode") == new  # decode accepts
        async with TransferService(config(**cluster.member("decode-2", "decode"))) as third:
            await decode.expect("from-decode", [1], sender=third.address)  # decode dials
            await eventually(lambda: decode.address in third.status()["peers"], WAIT_S, what="decode linked")
            assert proven_serial(third, decode.agent_name) == new
        await legit(prefill, decode, "after")
        assert decode._plane.control.generation_of(prefill.agent) == generation


def _mismatched(cluster: Authority, out: str, files: dict[str, Any]) -> tuple[str, str]:
    cert, _ = issue(cluster.dir, "decode", "decode-0", out, force=True)
    _, key = issue(cluster.dir, "decode", "decode-0", os.path.join(out, "other"), force=True)
    return cert, key


def _other_member(cluster: Authority, out: str, files: dict[str, Any]) -> tuple[str, str]:
    return issue(cluster.dir, "decode", "decode-9", out, force=True)


def _expired(cluster: Authority, out: str, files: dict[str, Any]) -> tuple[str, str]:
    return issue(cluster.dir, "decode", "decode-0", out, force=True,
                 not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=100), days=90)


def _half_written(cluster: Authority, out: str, files: dict[str, Any]) -> tuple[str, str]:
    """A certificate cut short, beside the key in force (only one of the two files changes)."""
    cert, _ = issue(cluster.dir, "decode", "decode-0", out, force=True)
    data = Path(cert).read_bytes()
    Path(cert).write_bytes(data[: len(data) // 2])
    return cert, files["identity_key_file"]


@pytest.mark.parametrize("bad", [_mismatched, _other_member, _expired, _half_written],
                         ids=lambda f: f.__name__.strip("_"))
async def test_a_bad_pair_is_refused_and_the_old_one_keeps_working(cluster: Authority, tmp_path: Path,
                                                                   bad: Any) -> None:
    """Decode-0's files are replaced by a pair that does not check out: refused, logged,
    counted once however many polls see it; the certificate before stays in force (a new
    link sees its serial) and prefill-0's requests pass byte-exact.  A good pair written
    after is put in force: the watch goes on."""
    out = tmp_path / "out"
    (out / "other").mkdir(parents=True)
    files = cluster.member("decode-0", "decode")
    async with (peers(peer_config(**cluster.member("prefill-0"))) as (prefill,),
                TransferService(config(**files)) as decode):
        await legit(prefill, decode, "before")
        old = serial_in_force(decode)
        cert, key = bad(cluster, str(out), files)
        with capture_logs() as logs:
            if key != files["identity_key_file"]:
                _replace(key, files["identity_key_file"])
            _replace(cert, files["identity_cert_file"])
            for n in range(ROUNDS):  # prefill's traffic while the pair is looked at (bounded)
                await legit(prefill, decode, f"during-{n}")
                if refused(decode, ROTATION_REFUSED):
                    break
            await eventually(lambda: refused(decode, ROTATION_REFUSED) >= 1, WAIT_S, what="the pair refused")
            await polls_pass(decode)
        assert refused(decode, ROTATION_REFUSED) == 1
        assert [e for e in logs if e["event"] == "identity.rotation_refused"], logs
        assert serial_in_force(decode) == old
        async with TransferService(config(**cluster.member("decode-1", "decode"))) as other:
            assert await linked_and_proven(other, decode, "to-decode") == old
        await legit(prefill, decode, "refused")

        good, _ = issue(cluster.dir, "decode", "decode-0", cluster.dir, force=True)
        await eventually(lambda: serial_in_force(decode) == serial_of(good), WAIT_S, what="a good pair in force")
        assert refused(decode, ROTATION_REFUSED) == 1
        await legit(prefill, decode, "after")


async def test_the_expiry_warning_follows_the_certificate_in_force(cluster: Authority) -> None:
    """Decode-0 starts with 90 days left: no warning.  Rotated to a certificate with 10
    days left, it warns while running (``status()["identity_warning"]`` and a log event);
    rotated again to 90 days, the warning clears."""
    files = cluster.member("decode-0", "decode")
    with capture_logs() as logs:
        async with TransferService(config(**files)) as decode:
            assert decode.status()["identity_warning"] == ""
            issue(cluster.dir, "decode", "decode-0", cluster.dir, force=True, days=10)
            await eventually(lambda: decode.status()["identity_warning"] != "", WAIT_S, what="the warning")
            warning = decode.status()["identity_warning"]
            assert "kvservice://c1/decode/decode-0 expires" in warning and "keygen issue" in warning, warning
            assert [e for e in logs if e["event"] == "identity.expiring"], logs
            issue(cluster.dir, "decode", "decode-0", cluster.dir, force=True, days=90)
            await eventually(lambda: decode.status()["identity_warning"] == "", WAIT_S, what="the warning cleared")
            assert refused(decode, ROTATION_REFUSED) == 0
    assert [e for e in logs if e["event"] == "identity.expiry_cleared"], logs
