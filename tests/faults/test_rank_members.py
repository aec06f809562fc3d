"""A decode takes an SGLang rank's address only from the rank's own member (docs/security.md
"Member identities").

Every member holds the cluster's key and a certificate of its own.  prefill-0's bootstrap
registry hands each rank's registration on as prefill-0 signed it; a decode with an
identity checks it and names the rank's member to its expect, and its service takes the
link at that address only from that member.  Mallory, a member, answers on the rank's
address (the port prefill-0 left), and whoever sits on the lookup's path alters the answer:
each is refused with its reason and counted; prefill-0's requests stay byte-exact.  Real
NIXL agents, a real prefill process, the registry's real HTTP server."""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvservice import FailureReason, TransferService
from kvservice._trust.keys import load_key
from kvservice.integrations.sglang import bootstrap, registration
from kvservice.testing import PeerProcess, pattern
from tests.faults.test_member_claims import INFO, identity_of
from tests.faults.test_member_identity import WAIT_S, Authority, named
from tests.helpers import SMALL, config, peer_config, peers

pytestmark = [pytest.mark.nixl]


@pytest.fixture
def cluster(tmp_path: Path) -> Authority:
    return Authority(tmp_path, "c1")


def decode_rank(bootstrap_addr: str, decode: TransferService) -> tuple[str, str | None]:
    """What an SGLang decode rank (``conn.KVManager``) does with a lookup: the rank 0/0
    holding its heads, and the member that must prove itself there."""
    info, ranks, members = registration.lookup_ranks(bootstrap_addr, decode.config.identity(), timeout=10)
    return registration.pick_rank(bootstrap_addr, info, ranks, members, INFO, 0, 0)


async def receive(prefill: PeerProcess, decode: TransferService, rid: str, address: str, member: str | None) -> None:
    """``rid`` from the prefill process into decode's last pages, byte for byte, expected
    as the SGLang receiver expects it (``member=``)."""
    last = SMALL.num_pages - 1
    src, dst = [3, 4, 5], [last - 2, last - 1, last]
    await prefill.command(op="fill", rid=rid, pages=src)
    await prefill.event("filled", rid)
    await decode.expect(rid, dst, sender=address, member=member)
    await prefill.command(op="send", rid=rid, pages=src, last=True)
    result = await decode.await_arrival(rid, timeout=WAIT_S)
    assert result.ok, result
    assert bool((decode.kv.pages(dst) == pattern(SMALL, rid, len(src))).all())


def refused(svc: TransferService, kind: str) -> int:
    return int(svc.status()["refused"].get(kind, 0))


async def test_a_member_answering_on_a_ranks_address_is_refused(cluster: Authority) -> None:
    """prefill-0 registered rank 0/0 at an address Mallory answers at now (the port it left
    as it restarted; its new incarnation has not registered yet).  The lookup proves the
    rank is prefill-0's; the decode dials the address, Mallory proves herself there, and the
    request fails ``REFUSED`` naming both members, counted ``identity_member``; Mallory
    never receives the Expect.  (Before, the decode took whoever held the cluster's key
    there: Mallory would write the room's KV.)  Once prefill-0's new incarnation registers,
    the next lookup's request arrives byte-exact."""
    prefill_files = cluster.member("prefill-0")
    owner = identity_of(prefill_files)
    key = load_key(cluster.key)
    reg = bootstrap.Registry("127.0.0.1", 0, key=key, identity=owner)
    where = f"127.0.0.1:{reg.port}"
    try:
        async with (peers(peer_config(**prefill_files)) as (prefill,),
                    TransferService(config(**cluster.member("decode-0", "decode"))) as decode,
                    TransferService(config(**cluster.member("mallory"))) as mallory):
            bootstrap.register(where, 0, 0, mallory.address, INFO, key=key, incarnation=named("prefill-0"),
                               identity=owner, timeout=10)
            address, member = decode_rank(where, decode)
            assert (address, member) == (mallory.address, "prefill-0")
            await decode.expect("taken", [1, 2], sender=address, member=member)
            result = await decode.await_arrival("taken", timeout=WAIT_S)
            assert result.reason is FailureReason.REFUSED, result
            assert "named as member 'prefill-0'" in result.message, result
            assert "proves member kvservice://c1/prefill/mallory" in result.message, result
            assert refused(decode, "identity_member") == 1
            assert not await mallory.expected("taken")
            assert await decode.await_settled("taken", timeout=WAIT_S)  # nothing was asked of her
            bootstrap.register(where, 0, 0, prefill.address, INFO, key=key, incarnation=prefill.agent,
                               identity=owner, timeout=10)
            address, member = decode_rank(where, decode)
            assert (address, member) == (prefill.address, "prefill-0")
            await receive(prefill, decode, "after", address, member)
            assert refused(decode, "identity_member") == 1
    finally:
        reg.close()


@contextmanager
def on_path(target: str, alter: Callable[[dict[str, Any]], dict[str, Any]]) -> Iterator[str]:
    """A relay between a decode and the registry at ``target`` that answers each lookup
    with ``alter`` of the registry's answer: its address."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10)
                conn.recv(65536)
                code, body = registration._call("GET", target, None, 10)
                data = json.dumps(alter(body)).encode()
                conn.sendall(f"HTTP/1.1 {code} OK\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                             .encode() + data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()


def test_a_lookup_altered_on_its_path_is_refused(cluster: Authority) -> None:
    """The registry's answer carries prefill-0's signed registration of rank 0/0; on the
    lookup's path it is altered: the rank's address swapped for Mallory's, the signatures
    dropped, Mallory's own signed registration put in for the rank's but under the rank's
    address, the signature of another registration.  A decode with an identity refuses
    each (``UnprovenRanks``, saying why: the SGLang receiver fails ``REFUSED``); the
    real answer names prefill-0.  A decode without an identity reads the addresses as
    before."""
    owner = identity_of(cluster.member("prefill-0"))
    mallory = identity_of(cluster.member("mallory"))
    decode = identity_of(cluster.member("decode-0", "decode"))
    key = load_key(cluster.key)
    reg = bootstrap.Registry("127.0.0.1", 0, key=key, identity=owner)
    target = f"127.0.0.1:{reg.port}"
    try:
        bootstrap.register(target, 0, 0, "127.0.0.1:7000", INFO, key=key, incarnation=named("prefill-0"),
                           identity=owner, timeout=10)
        assert registration.lookup_members(target, decode, timeout=10)[1:] == (
            {"0/0": "127.0.0.1:7000"}, {"0/0": "prefill-0"})
        genuine = registration._call("GET", target, None, 10)[1]
        theirs = json.dumps({"dp_rank": 0, "tp_rank": 0, "address": "127.0.0.1:7000", "info": INFO,
                             "incarnation": named("mallory"), "ts": 0, "nonce": "0" * 32}).encode()

        def swapped(body: dict[str, Any]) -> dict[str, Any]:
            return {**body, "ranks": {"0/0": "127.0.0.1:7001"}}

        def unsigned(body: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in body.items() if k != "proofs"}

        def malloried(body: dict[str, Any]) -> dict[str, Any]:  # signed by Mallory: proves Mallory
            proof = {"registration": base64.b64encode(theirs).decode(), "cert": 0,
                     "signature": base64.b64encode(mallory.sign(registration.signed_part(theirs))).decode()}
            return {**body, "proofs": {"certs": [base64.b64encode(mallory.der).decode()], "ranks": {"0/0": proof}}}

        def forged(body: dict[str, Any]) -> dict[str, Any]:  # prefill-0's certificate, Mallory's signature
            proof = {**body["proofs"]["ranks"]["0/0"],
                     "signature": base64.b64encode(mallory.sign(b"something else")).decode()}
            return {**body, "proofs": {**body["proofs"], "ranks": {"0/0": proof}}}

        for alter, why in ((swapped, "its signed registration is rank 0/0 at 127.0.0.1:7000"),
                           (unsigned, "carries no signed registrations"),
                           (forged, "does not prove a member: .* does not verify")):
            with on_path(target, alter) as relay, pytest.raises(registration.UnprovenRanks, match=why):
                registration.lookup_ranks(relay, decode, timeout=10)
            with on_path(target, alter) as relay:  # a decode without an identity: as before
                assert registration.lookup_ranks(relay, None, timeout=10)[2] is None
        with on_path(target, malloried) as relay:  # Mallory's own: names Mallory, whom the link must prove
            assert registration.lookup_ranks(relay, decode, timeout=10)[2] == {"0/0": "mallory"}
        assert genuine["proofs"]["ranks"]["0/0"]["cert"] == 0
    finally:
        reg.close()


def test_the_rank_a_decode_picks_and_the_member_it_names() -> None:
    """``pick_rank`` (what ``conn.KVManager.prefill_address`` does): the rank with the
    decode rank's heads and its member; a pool that does not pair, or a rank not
    registered, is a ``ValueError`` saying which; without identities no member is named."""
    ranks = {"0/0": "127.0.0.1:7000", "1/0": "127.0.0.1:7001"}
    members = {"0/0": "prefill-0", "1/0": "prefill-0"}
    assert registration.pick_rank("b:1", INFO, ranks, members, INFO, 1, 0) == ("127.0.0.1:7001", "prefill-0")
    assert registration.pick_rank("b:1", INFO, ranks, None, INFO, 0, 0) == ("127.0.0.1:7000", None)
    with pytest.raises(ValueError, match="no rank dp=0 tp=1 registered"):
        registration.pick_rank("b:1", INFO, ranks, members, INFO, 0, 1)
    with pytest.raises(ValueError, match="needs the same attention TP size, page size"):
        registration.pick_rank("b:1", INFO, ranks, members, {**INFO, "page_size": 32}, 0, 0)


def test_a_registry_without_an_identity_proves_no_member(cluster: Authority) -> None:
    """A prefill whose registry has no identity hands on no signed registrations: a decode
    with an identity refuses it (``UnprovenRanks``), one without reads it as before."""
    key = load_key(cluster.key)
    reg = bootstrap.Registry("127.0.0.1", 0, key=key)
    target = f"127.0.0.1:{reg.port}"
    try:
        bootstrap.register(target, 0, 0, "127.0.0.1:7000", INFO, key=key, incarnation=named("prefill-0"), timeout=10)
        with pytest.raises(registration.UnprovenRanks, match="carries no signed registrations"):
            registration.lookup_ranks(target, identity_of(cluster.member("decode-0", "decode")), timeout=10)
        assert registration.lookup_ranks(target, None, timeout=10) == (INFO, {"0/0": "127.0.0.1:7000"}, None)
    finally:
        reg.close()
