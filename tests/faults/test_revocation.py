"""A revoked member's certificate (docs/security.md "Revocation").

The cluster's authority revokes mallory's certificate (``kvservice keygen revoke``): a
decode configured with the list (``revoked_file``) refuses mallory's new links whichever
side dials, closes the link mallory already holds once the list changes, and leaves
prefill-0 (a real process) alone, its requests byte-exact throughout.  A list the
authority did not sign, or garbage, is refused at start and ignored when reloaded: the
last good one stays in force.  Real NIXL agents, a real prefill process."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvservice import FailureReason, TransferService
from kvservice._results import ConfigError
from kvservice._trust.authority import REVOKED_LIST, issue, revoke, serial_of
from kvservice.testing import PeerProcess
from tests.faults.test_member_identity import (
    WAIT_S,
    Authority,
    handshakes,
    legit,
    mallory_dials,
    named,
    presenting,
    refused,
)
from tests.helpers import config, eventually, peer_config, peers

pytestmark = [pytest.mark.nixl]


@pytest.fixture
def cluster(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


def revoking(cluster: Authority, *members: dict[str, Any]) -> str:
    """The cluster's list, revoking ``members``' certificates (and what it revoked before)."""
    path, _ = revoke(cluster.dir, [serial_of(m["identity_cert_file"]) for m in members])
    return path


def decode_config(cluster: Authority, **kw: Any) -> Any:
    return config(**cluster.member("decode-0", "decode"), revoked_file=os.path.join(cluster.dir, REVOKED_LIST),
                  **kw)


async def traffic(prefill: PeerProcess, decode: TransferService, tag: str, rounds: int = 3) -> None:
    """``rounds`` requests from prefill into decode, each byte-exact (``legit``)."""
    for n in range(rounds):
        await legit(prefill, decode, f"{tag}-{n}")


@pytest.mark.parametrize("side", ["mallory_dials", "decode_dials"])
async def test_a_revoked_member_is_refused_whichever_side_dials(cluster: Authority, side: str) -> None:
    """Mallory's certificate is on the list: its handshake is refused saying the member and
    "revoked", counted (``identity_revoked``); prefill's requests pass byte-exact."""
    mallory_files = cluster.member("mallory")
    revoking(cluster, mallory_files)
    async with (peers(peer_config(**cluster.member("prefill-0"))) as (prefill,),
                TransferService(decode_config(cluster)) as decode):
        await legit(prefill, decode, "before")
        async with TransferService(config(**mallory_files)) as mallory:
            if side == "mallory_dials":
                result = await mallory_dials(mallory, decode, "claim")
            else:
                await decode.expect("claim", [1], sender=mallory.address)
                result = await decode.await_arrival("claim", timeout=WAIT_S)
            assert result.reason is FailureReason.REFUSED, result
            assert "member kvservice://c1/prefill/mallory is revoked" in result.message, result
            assert refused(decode, "identity_revoked") == 1
            assert decode.status()["peers"] == [prefill.address]
        await legit(prefill, decode, "after")


async def test_a_link_is_closed_when_its_member_is_revoked(cluster: Authority) -> None:
    """Mallory is linked to decode, each holding a request of the other's, when the list
    changes to revoke it: decode closes that link (its request fails naming mallory and
    "revoked"), mallory's own request fails, and mallory's next link is refused.
    Prefill-0's link is the same link throughout and its requests stay byte-exact."""
    mallory_files = cluster.member("mallory")
    revoking(cluster)  # an empty list to start with
    async with (peers(peer_config(**cluster.member("prefill-0"))) as (prefill,),
                TransferService(decode_config(cluster)) as decode,
                TransferService(config(**mallory_files)) as mallory):
        await legit(prefill, decode, "before")
        await mallory.expect("m-1", [1], sender=decode.address)  # mallory dials decode
        await decode.expect("d-1", [2], sender=mallory.address)  # over that link
        await eventually(lambda: mallory.address in decode.status()["peers"], WAIT_S, what="mallory linked")
        generation = decode._plane.control.generation_of(prefill.agent) if decode._plane else None
        assert generation is not None

        revoking(cluster, mallory_files)
        for n in range(40):  # prefill's traffic while the list takes effect (bounded)
            await legit(prefill, decode, f"during-{n}")
            if mallory.address not in decode.status()["peers"]:
                break
        await eventually(lambda: mallory.address not in decode.status()["peers"], WAIT_S, what="mallory dropped")
        failed = await decode.await_arrival("d-1", timeout=WAIT_S)
        assert failed.reason is FailureReason.PEER_LOST, failed
        assert "member kvservice://c1/prefill/mallory is revoked" in failed.message, failed
        assert not (await mallory.await_arrival("m-1", timeout=WAIT_S)).ok
        assert refused(decode, "identity_revoked") == 1

        again = await mallory_dials(mallory, decode, "m-2")
        assert again.reason is FailureReason.REFUSED and "revoked" in again.message, again
        assert refused(decode, "identity_revoked") == 2
        assert decode._plane is not None and decode._plane.control.generation_of(prefill.agent) == generation
        assert decode.status()["peers"] == [prefill.address]
        await traffic(prefill, decode, "after")


def _other_authority(cluster: Authority, root: Path, prefill: dict[str, Any]) -> bytes:
    """A list revoking prefill-0, signed by another authority of the same cluster's name."""
    other = Authority(root, cluster="c1", key=cluster.key)
    path, _ = revoke(other.dir, [serial_of(prefill["identity_cert_file"])])
    with open(path, "rb") as f:
        return f.read()


def _get(path: str) -> bytes:
    return Path(path).read_bytes()


def _put(path: str, data: bytes) -> None:
    """``path`` replaced by ``data`` at once (as ``revoke`` writes it: a rename)."""
    Path(path + ".new").write_bytes(data)
    os.replace(path + ".new", path)


def _garbage(cluster: Authority, root: Path, prefill: dict[str, Any]) -> bytes:
    return b"-----BEGIN X509 CRL-----\nnot a list\n-----END X509 CRL-----\n"


@pytest.mark.parametrize("forge", [_other_authority, _garbage], ids=lambda f: f.__name__.strip("_"))
async def test_a_forged_list_is_ignored(cluster: Authority, tmp_path: Path, forge: Any) -> None:
    """The list is replaced by one the cluster's authority did not sign (revoking prefill-0),
    or by garbage: logged, counted (``revocation_list``) and ignored; prefill-0's link and
    requests go on byte-exact.  The last good list stays in force and the watch goes on: a
    good list revoking mallory then closes mallory's link.  The same file at start is a
    ``ConfigError`` saying why."""
    prefill_files = cluster.member("prefill-0")
    mallory_files = cluster.member("mallory")
    path = revoking(cluster)
    async with (peers(peer_config(**prefill_files)) as (prefill,),
                TransferService(decode_config(cluster)) as decode,
                TransferService(config(**mallory_files)) as mallory):
        await legit(prefill, decode, "before")
        await mallory.expect("m-1", [1], sender=decode.address)
        await eventually(lambda: mallory.address in decode.status()["peers"], WAIT_S, what="mallory linked")
        good = _get(path)
        forged = forge(cluster, tmp_path, prefill_files)
        _put(path, forged)
        for n in range(40):  # prefill's traffic while the forged list is looked at (bounded)
            await legit(prefill, decode, f"during-{n}")
            if refused(decode, "revocation_list"):
                break
        await eventually(lambda: refused(decode, "revocation_list") >= 1, WAIT_S, what="the list refused")
        await traffic(prefill, decode, "forged")
        assert sorted(decode.status()["peers"]) == sorted([prefill.address, mallory.address])
        assert handshakes(decode).revocations is not None
        assert handshakes(decode).revocations.current.serials == frozenset()  # the last good one

        _put(path, good)
        revoking(cluster, mallory_files)
        await eventually(lambda: mallory.address not in decode.status()["peers"], WAIT_S, what="mallory dropped")
        assert decode.status()["peers"] == [prefill.address]
        await traffic(prefill, decode, "after")

    _put(path, forged)
    with pytest.raises(ConfigError, match=r"revoked_file: .*(not signed by the cluster's authority|not an X\.509)"):
        decode_config(cluster)


# -- expiry -----------------------------------------------------------------------------------------


async def test_a_certificate_near_its_end_is_warned_of(cluster: Authority) -> None:
    """A decode whose own certificate ends in 10 days says so when it starts (a log event)
    and in ``status()["identity_warning"]``; one with 90 days left says nothing."""
    soon = cluster.member("decode-0", "decode")
    soon["identity_cert_file"], soon["identity_key_file"] = issue(cluster.dir, "decode", "decode-1", cluster.dir,
                                                                  days=10)
    with capture_logs() as logs:
        async with TransferService(config(**soon)) as decode:
            warning = decode.status()["identity_warning"]
    assert "kvservice://c1/decode/decode-1 expires" in warning and "keygen issue" in warning, warning
    assert [e for e in logs if e["event"] == "identity.expiring"], logs
    async with TransferService(config(**cluster.member("decode-2", "decode"))) as decode:
        assert decode.status()["identity_warning"] == ""


async def test_an_expired_certificate_is_refused_when_decode_dials(cluster: Authority) -> None:
    """The hostile side answers: decode dials mallory, which presents a certificate the
    cluster's authority issued but that ended yesterday: refused ("not now"), counted on
    decode (the dialler that refused), nothing linked; prefill's requests pass byte-exact.
    (When mallory dials with it, tests/faults/test_member_identity.py refuses it.)"""
    async with (peers(peer_config(**cluster.member("prefill-0"))) as (prefill,),
                TransferService(config(**cluster.member("decode-0", "decode"))) as decode):
        await legit(prefill, decode, "before")
        der, key = cluster.forged("kvservice://c1/prefill/mallory",
                                  start=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))
        mallory = TransferService(config(**cluster.member("mallory")))
        mallory.agent_name = named("mallory")
        async with mallory:
            presenting(mallory, der, key)
            await decode.expect("claim", [1], sender=mallory.address)
            result = await decode.await_arrival("claim", timeout=WAIT_S)
            assert result.reason is FailureReason.REFUSED, result
            assert "not now" in result.message, result
            assert refused(decode, "identity") == 1
            assert decode.status()["peers"] == [prefill.address]
        await legit(prefill, decode, "after")
