"""One identity per member: a member speaks for itself only (docs/security.md "Member
identities").

Every service here holds the cluster's key; each also holds its own member key and a
certificate from the cluster's authority.  Mallory is a member too (a certificate of its
own, or one that does not check out) and claims what is another member's: its agent
name, a settle of its pages.  Each claim is refused at the handshake, with a reason,
counted, and legitimate traffic from the real prefill process stays byte-exact.  Real
NIXL agents, a real prefill process, real SIGSTOP/SIGKILL."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import secrets
import signal
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from kvservice import FailureReason, KVLayout, KVPoll, TransferService
from kvservice._control.handshakes import Handshakes
from kvservice._control.protocol import Settled
from kvservice._trust.authority import CA_CERT, CA_KEY, create_authority, issue
from kvservice._trust.identity import Identity, member_of
from kvservice._trust.keys import generate_key
from kvservice.testing import PeerProcess, pattern
from kvservice.testing.inspect import inside
from tests.faults.test_settle import LAYOUT, PAGES, TCP, send_then_stop
from tests.helpers import SMALL, config, eventually, peer_config, peers, scaled

pytestmark = [pytest.mark.nixl]

WAIT_S = 60.0  # a hang guard for each wait, never a timed assertion
CLUSTER = "c1"


class Authority:
    """A cluster's CA in a directory, the cluster's key, and members issued from them."""

    def __init__(self, root: Path, cluster: str = CLUSTER, key: str | None = None) -> None:
        self.dir = str(root / f"ca-{cluster}-{secrets.token_hex(4)}")
        os.mkdir(self.dir)
        create_authority(self.dir, cluster)
        self.ca = os.path.join(self.dir, CA_CERT)
        if key is None:
            key = os.path.join(self.dir, "cluster.key")
            generate_key(key)
        self.key = key

    def member(self, name: str, role: str = "prefill") -> dict[str, Any]:
        """A member's settings: its own key and certificate, the CA, the cluster's key."""
        cert, key = issue(self.dir, role, name, self.dir, force=True)
        return {"auth_key_file": self.key, "identity_cert_file": cert, "identity_key_file": key,
                "identity_ca_file": self.ca}

    def forged(self, uri: str, *, start: dt.datetime | None = None, days: float = 1.0) -> tuple[bytes, Any]:
        """A certificate this CA signs naming ``uri`` (any cluster), valid from ``start``
        for ``days``: (its DER, its private key)."""
        with open(self.ca, "rb") as f:
            ca = x509.load_pem_x509_certificate(f.read())
        with open(os.path.join(self.dir, CA_KEY), "rb") as f:
            ca_key = serialization.load_pem_private_key(f.read(), None)
        assert isinstance(ca_key, ed25519.Ed25519PrivateKey)
        key = ed25519.Ed25519PrivateKey.generate()
        start = start or dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
        cert = (x509.CertificateBuilder().subject_name(x509.Name([])).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False)
                .sign(ca_key, None))
        return cert.public_bytes(serialization.Encoding.DER), key


@pytest.fixture
def cluster(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


def refused(svc: TransferService, kind: str) -> int:
    return int(svc.status()["refused"].get(kind, 0))


def handshakes(svc: TransferService) -> Handshakes:
    return inside(svc).handshakes


def presenting(svc: TransferService, der: bytes, key: Any) -> None:
    """Make ``svc`` present certificate ``der`` (signing with ``key``) in its handshakes,
    past the checks its own start makes of its files: what a hostile member can send."""
    hs = handshakes(svc)
    own = hs._identity
    assert own is not None
    hs._identity = Identity(x509.load_der_x509_certificate(der), der, key, own.ca, own.member)


def named(member: str) -> str:
    """A fresh agent name of ``member`` (what its services speak under)."""
    return f"{member}-{secrets.token_hex(6)}"


async def legit(prefill: PeerProcess, decode: TransferService, rid: str, layout: KVLayout = SMALL) -> None:
    """``rid`` from the prefill process into decode, byte for byte (into pages no test holds)."""
    last = layout.num_pages - 1
    src, dst = [3, 4, 5], [last - 2, last - 1, last]
    await prefill.command(op="fill", rid=rid, pages=src)
    await prefill.event("filled", rid)
    await decode.expect(rid, dst, sender=prefill.address)
    await prefill.command(op="send", rid=rid, pages=src, last=True)
    result = await decode.await_arrival(rid, timeout=WAIT_S)
    assert result.ok, result
    assert bool((decode.kv.pages(dst) == pattern(layout, rid, len(src))).all())


async def mallory_dials(mallory: TransferService, decode: TransferService, rid: str) -> Any:
    """Mallory links to decode (its expect dials the sender it names): the result."""
    await mallory.expect(rid, [1], sender=decode.address)
    return await mallory.await_arrival(rid, timeout=WAIT_S)


# -- members link, each proven to the other -------------------------------------------------------


async def test_members_prove_each_other_both_ways(cluster: Authority) -> None:
    """Prefill (a process) and decode link with identities: each side's link carries the
    other's proven member, agents are named after their members, requests pass byte-exact
    whichever side dialled."""
    async with (peers(peer_config(**cluster.member("prefill-0"))) as (prefill,),
                TransferService(config(**cluster.member("decode-0", "decode"))) as decode):
        assert prefill.agent.startswith("prefill-0-") and decode.agent_name.startswith("decode-0-")
        src = [5, 6]  # prefill dials first: decode sends to it
        decode.kv.write(src, pattern(SMALL, "r-0", len(src)))
        await prefill.command(op="expect", rid="r-0", pages=[20, 21], sender=decode.address)
        await prefill.event("expecting", "r-0")
        handle = await decode.send("r-0", src, last=True)
        assert (await decode.await_completion(handle, timeout=WAIT_S)).ok
        arrived = await prefill.event("arrived", "r-0")
        assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived
        await legit(prefill, decode, "r-1")  # over the link prefill dialled
        proven = handshakes(decode).members[prefill.agent]
        assert proven is not None and proven.uri == "kvservice://c1/prefill/prefill-0"
        assert refused(decode, "identity") == refused(decode, "identity_missing") == 0


# -- one row per claim: made by one member for another --------------------------------------------


@pytest.mark.parametrize("side", ["mallory_dials", "decode_dials"])
async def test_a_member_cannot_speak_under_another_members_agent_name(cluster: Authority, side: str) -> None:
    """Mallory, a member with a valid certificate of its own, speaks under prefill-0's
    agent name: refused at the handshake whichever side dials, saying whose name its
    certificate holds, counted on decode when decode accepts.  Prefill's requests pass."""
    async with (peers(peer_config(**cluster.member("prefill-0"))) as (prefill,),
                TransferService(config(**cluster.member("decode-0", "decode"))) as decode):
        await legit(prefill, decode, "before")
        thief = TransferService(config(**cluster.member("mallory")))
        assert thief.agent_name.startswith("mallory-")
        thief.agent_name = named("prefill-0")  # as a hostile build of kvservice does
        async with thief:
            if side == "mallory_dials":
                result = await mallory_dials(thief, decode, "claim")
                assert result.reason is FailureReason.REFUSED, result
                assert "certificate names member 'mallory'" in result.message, result
                assert refused(decode, "identity") == 1
            else:
                await decode.expect("claim", [1], sender=thief.address)
                result = await decode.await_arrival("claim", timeout=WAIT_S)
                assert result.reason is FailureReason.REFUSED, result
                assert "certificate names member 'mallory'" in result.message, result
                assert refused(decode, "identity") == 1  # counted by the dialler that refused
            assert decode.status()["peers"] == [prefill.address]
        await legit(prefill, decode, "after")


@pytest.mark.slow
@pytest.mark.parametrize("mallory_has", ["its_own_identity", "no_identity"])
async def test_a_member_cannot_settle_another_members_pages(cluster: Authority, mallory_has: str) -> None:
    """Decode's request from prefill-0 fails while prefill-0 is SIGSTOPped mid-copy: its
    pages stay held.  Mallory links to decode under prefill-0's agent name and says
    ``Settled``: refused at the handshake (a certificate naming mallory; or, where decode
    lets peers without an identity link, none, for an agent name a member proved), so
    nothing settles.  Before, the link was taken and the settle believed: the pages were
    reused and prefill-0's late WRITE overwrote them.  Once prefill-0 is SIGKILLed decode
    settles; prefill-1's requests pass byte-exact throughout."""
    keyed = {"ucx_env": TCP, "heartbeat_interval_s": 0.2, "peer_timeout_s": scaled(1.0)}
    allow = mallory_has == "no_identity"
    mallory_cfg = ({**cluster.member("mallory"), **keyed} if not allow
                   else {"auth_key_file": cluster.key, **keyed})
    async with (peers(peer_config(LAYOUT, **cluster.member("prefill-0"), **keyed),
                      peer_config(LAYOUT, **cluster.member("prefill-1"), **keyed), env=TCP) as (stalled, prefill),
                TransferService(config(LAYOUT, **cluster.member("decode-0", "decode"), **keyed,
                                       allow_peers_without_identity=allow)) as decode):
        await send_then_stop(stalled, decode, "held")
        try:
            failed = await decode.await_arrival("held", timeout=WAIT_S)
            assert failed.reason in (FailureReason.TIMEOUT, FailureReason.PEER_LOST), failed
            await eventually(lambda: stalled.address not in decode.status()["peers"], WAIT_S)
            mallory = TransferService(config(LAYOUT, **mallory_cfg))
            mallory.agent_name = stalled.agent
            async with mallory:
                await mallory.expect("m-1", [1], sender=decode.address)  # mallory dials decode
                await eventually(lambda: mallory.address in decode.status()["peers"]  # linked (as before)
                                 or mallory.poll_arrival("m-1") is KVPoll.Failed, WAIT_S)  # or refused
                inside(mallory).plane.send_to(decode.agent_name, Settled("held"))  # heard, were it linked
                still = await decode.await_settled("held", timeout=3.0)
                assert not still.settled, still
                assert decode.status()["unsettled_pages"] == len(PAGES)
                result = await mallory.await_arrival("m-1", timeout=WAIT_S)
                assert result.reason is FailureReason.REFUSED, result
                said = "certificate names member 'mallory'" if not allow else "was proven by member"
                assert said in result.message, result
                assert refused(decode, "identity") == 1
            await legit(prefill, decode, "during", LAYOUT)
        finally:
            stalled.signal(signal.SIGKILL)
        with anyio.fail_after(WAIT_S):
            settled = await decode.await_settled("held")
        assert settled.settled and not settled.ok, settled
        assert decode.status()["unsettled_pages"] == 0
        await legit(prefill, decode, "after", LAYOUT)


# -- certificates that do not check out ------------------------------------------------------------

Forge = Callable[[Authority, Path], tuple[bytes, Any, str]]


def _expired(ca: Authority, root: Path) -> tuple[bytes, Any, str]:
    der, key = ca.forged("kvservice://c1/prefill/mallory", start=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))
    return der, key, "not now"


def _not_yet_valid(ca: Authority, root: Path) -> tuple[bytes, Any, str]:
    der, key = ca.forged("kvservice://c1/prefill/mallory", start=dt.datetime.now(dt.UTC) + dt.timedelta(days=1))
    return der, key, "not now"


def _other_ca(ca: Authority, root: Path) -> tuple[bytes, Any, str]:
    der, key = Authority(root, CLUSTER, ca.key).forged("kvservice://c1/prefill/mallory")
    return der, key, "not issued by this cluster's authority"


def _other_cluster(ca: Authority, root: Path) -> tuple[bytes, Any, str]:
    der, key = ca.forged("kvservice://c2/prefill/mallory")
    return der, key, "for cluster 'c2'"


def _no_member(ca: Authority, root: Path) -> tuple[bytes, Any, str]:
    der, key = ca.forged("https://c1.example/mallory")
    return der, key, "names 0 kvservice members"


def _without_its_key(ca: Authority, root: Path) -> tuple[bytes, Any, str]:
    """prefill-0's real certificate (public: it is sent in every handshake), signed for
    with mallory's own key."""
    files = ca.member("prefill-0")
    with open(files["identity_cert_file"], "rb") as f:
        der = x509.load_pem_x509_certificate(f.read()).public_bytes(serialization.Encoding.DER)
    return der, ed25519.Ed25519PrivateKey.generate(), "signature over the handshake does not verify"


@pytest.mark.parametrize("forge", [_expired, _not_yet_valid, _other_ca, _other_cluster, _no_member,
                                   _without_its_key], ids=lambda f: f.__name__.strip("_"))
async def test_a_certificate_that_does_not_check_out_is_refused(cluster: Authority, tmp_path: Path,
                                                                forge: Forge) -> None:
    """Mallory holds the cluster's key but presents a certificate that is not a valid
    member's here: refused with the reason, counted (``identity``), its claim linked to
    nothing; prefill's requests pass byte-exact before and after."""
    der, key, said = forge(cluster, tmp_path)
    async with (peers(peer_config(**cluster.member("prefill-0"))) as (prefill,),
                TransferService(config(**cluster.member("decode-0", "decode"))) as decode):
        await legit(prefill, decode, "before")
        cert = x509.load_der_x509_certificate(der)
        try:
            name = member_of(cert).name
        except ValueError:
            name = "mallory"
        mallory = TransferService(config(**cluster.member("mallory")))
        mallory.agent_name = named(name)
        async with mallory:
            presenting(mallory, der, key)
            result = await mallory_dials(mallory, decode, "claim")
            assert result.reason is FailureReason.REFUSED, result
            assert said in result.message, result
            assert refused(decode, "identity") == 1
            assert decode.status()["peers"] == [prefill.address]
        await legit(prefill, decode, "after")


# -- mixed fleets ----------------------------------------------------------------------------------


async def test_a_peer_without_identity_is_refused_unless_allowed(cluster: Authority) -> None:
    """Decode has an identity, prefill (a process) and mallory hold only the cluster's
    key: refused both ways (``identity_missing``, counted each time), with a
    reason that names the setting; with ``allow_peers_without_identity`` they link and
    prefill's requests pass byte-exact."""
    plain: dict[str, Any] = {"auth_key_file": cluster.key}
    async with peers(peer_config(**plain)) as (prefill,):
        async with TransferService(config(**cluster.member("decode-0", "decode"))) as decode:
            await decode.expect("r-1", [1], sender=prefill.address)
            result = await decode.await_arrival("r-1", timeout=WAIT_S)
            assert result.reason is FailureReason.REFUSED, result
            assert "proves no member identity" in result.message, result
            async with TransferService(config(**plain)) as mallory:
                result = await mallory_dials(mallory, decode, "m-1")
                assert result.reason is FailureReason.REFUSED, result
                assert "allow_peers_without_identity" in result.message, result
            assert refused(decode, "identity_missing") == 2  # once dialling, once accepting
        cfg = config(**cluster.member("decode-1", "decode"), allow_peers_without_identity=True)
        async with TransferService(cfg) as decode:
            await legit(prefill, decode, "allowed")
            assert handshakes(decode).members[prefill.agent] is None


# -- nobody on the path talks two members out of proving themselves --------------------------------


@contextlib.asynccontextmanager
async def lowering_relay(target: str, way: str) -> AsyncIterator[str]:
    """A TCP relay to ``target`` that sets ``ident`` to 0 in the first frame going ``way``
    ("up": the dialer's Hello; "down": the acceptor's), as a party on the path would to make
    a member look like a release without identities; everything else it carries as is."""
    host, port = target.rsplit(":", 1)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)

    async def pipe(src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream, lower: bool) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            buf = b""
            while lower:  # the first frame, whole, rewritten
                buf += await src.receive()
                if len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
                    n = struct.unpack(">I", buf[:4])[0]
                    hello = msgspec.msgpack.decode(buf[4:4 + n])
                    hello["ident"] = 0
                    body = msgspec.msgpack.encode(hello)
                    await dst.send(struct.pack(">I", len(body)) + body + buf[4 + n:])
                    break
            async for data in src:
                await dst.send(data)
        with contextlib.suppress(Exception):
            await dst.aclose()

    async def serve(client: anyio.abc.SocketStream) -> None:
        server = await anyio.connect_tcp(host, int(port))
        async with client, server, anyio.create_task_group() as tg:
            tg.start_soon(pipe, client, server, way == "up")
            tg.start_soon(pipe, server, client, way == "down")

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        try:
            yield f"127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        finally:
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("way", ["up", "down"])
async def test_a_party_on_the_path_cannot_lower_a_members_ident(cluster: Authority, way: str) -> None:
    """Two members that both let peers without an identity link (a fleet on its way to
    identities), linked through a relay that lowers one Hello's ``ident`` to 0 ("a release
    without identities"): the proofs cover both, so the link is refused (before, it came up
    with neither member proven).  Directly, they link proven."""
    allow = {"allow_peers_without_identity": True}
    async with (TransferService(config(**cluster.member("prefill-0"), **allow)) as prefill,
                TransferService(config(**cluster.member("decode-0", "decode"), **allow)) as decode,
                lowering_relay(prefill.address, way) as via):
        prefill.kv.write([1, 2], pattern(SMALL, "relayed", 2))
        await prefill.send("relayed", [1, 2], last=True)
        await decode.expect("relayed", [7, 8], sender=via)
        result = await decode.await_arrival("relayed", timeout=WAIT_S)
        assert result.reason is FailureReason.REFUSED, result
        assert "authentication failed" in result.message, result
        assert prefill.agent_name not in handshakes(decode).members
        assert decode.status()["peers"] == [] and prefill.status()["peers"] == []
        await prefill.abort("relayed")
        prefill.kv.write([3, 4], pattern(SMALL, "direct", 2))
        sent = await prefill.send("direct", [3, 4], last=True)
        await decode.expect("direct", [9, 10], sender=prefill.address)
        assert (await prefill.await_completion(sent, timeout=WAIT_S)).ok
        assert (await decode.await_arrival("direct", timeout=WAIT_S)).ok
        assert bool((decode.kv.pages([9, 10]) == pattern(SMALL, "direct", 2)).all())
        proven = handshakes(decode).members[prefill.agent_name]
        assert proven is not None and proven.name == "prefill-0"
