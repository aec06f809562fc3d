"""vLLM hand-offs signed by the prefill member that will send (docs/vllm.md "Trust"): with
member identities a decode takes a hand-off only from a prefill member of its cluster, not
revoked, that signed exactly its fields, and pins the load to that member.

Every member here holds the cluster's key, so each can MAC anything: what they cannot do is
sign as another member.  The refusals happen in the decode's scheduler before anything is
reserved; that the pinned load is refused by a sender proving another member, and that a
good one is byte-exact, is shown with real NIXL in ``tests/faults/test_vllm_handoff_members.py``."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvservice._trust.authority import revoke, serial_of
from kvservice._trust.handoff import handoff_key
from kvservice._trust.identity import Identity, load_identity
from kvservice._trust.revocation import RevocationWatch
from kvservice.integrations.vllm import scheduler
from kvservice.integrations.vllm.params import MEMBER_KEY, HandoffError, handoff_from
from kvservice.integrations.vllm.scheduler import RecvSpec, SchedulerSide, Work
from tests.faults.test_member_identity import Authority
from tests.unit.test_vllm_side import NOW, Req, worker

A_SENDER = "127.0.0.1:7100"
M_SENDER = "127.0.0.1:7200"


@pytest.fixture
def cluster(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


def identity(files: dict[str, Any]) -> Identity:
    return load_identity(files["identity_cert_file"], files["identity_key_file"], files["identity_ca_file"])


def cluster_key(cluster: Authority) -> bytes:
    with open(cluster.key, "rb") as f:
        key = handoff_key(bytes.fromhex(f.read().decode().strip()))
    assert key is not None
    return key


def issued(cluster: Authority, who: Identity | None, rid: str = "p0", sender: str = A_SENDER) -> dict[str, Any]:
    """A hand-off as the prefill scheduler of member ``who`` answers it, naming ``sender``."""
    p = SchedulerSide(block_size=32, producer=True, consumer=False, senders=(sender,), key=cluster_key(cluster),
                      clock=lambda: NOW, identity=who)
    _, params = p.request_finished(Req(rid, {"do_remote_decode": True}, num_computed_tokens=70), [1, 2, 3])
    assert params is not None
    return params


def decode(cluster: Authority, who: Identity | None, *, revocations: RevocationWatch | None = None,
           allow: bool = False) -> SchedulerSide:
    return SchedulerSide(block_size=32, producer=False, consumer=True, senders=(), key=cluster_key(cluster),
                         clock=lambda: NOW + 1, identity=who, revocations=revocations, allow_without_identity=allow)


def loaded(d: SchedulerSide, rid: str, params: dict[str, Any]) -> RecvSpec | None:
    """What the decode's workers are told to load for ``params`` (None: refused)."""
    req = Req(rid, json.loads(json.dumps(params)))  # as it travels: JSON through the router
    if d.get_num_new_matched_tokens(req, 0) != (70, True):
        return None
    d.update_state_after_alloc(req, [7, 8, 9], 70)
    (recv,) = d.build().recvs
    return recv


def test_a_prefill_member_signs_its_handoff_and_the_decode_loads_it_from_that_member_alone(
        cluster: Authority) -> None:
    a = identity(cluster.member("prefill-a"))
    params = issued(cluster, a)
    cert, signature = (base64.b64decode(params[MEMBER_KEY][k]) for k in ("cert", "signature"))
    assert cert == a.der and len(signature) == 64  # Ed25519
    # the record itself is the one a decode without identities reads (and MACs) as before
    assert handoff_from({k: v for k, v in params.items() if k != MEMBER_KEY}) == \
        dataclasses.replace(handoff_from(params), proof=None)
    # the proof's cost on the wire: 912 bytes of JSON with it, 329 without (an Ed25519 member)
    assert len(json.dumps(params)) - len(json.dumps({k: v for k, v in params.items() if k != MEMBER_KEY})) < 640
    d = decode(cluster, identity(cluster.member("decode-0", "decode")))
    recv = loaded(d, "d0", params)
    assert recv is not None and recv.handoff.member == "prefill-a", d.counts
    assert d.counts == {"loads": 1}
    # the worker pins every rank's load to that member
    w, engine = worker(1, 0)
    w.start(Work(recvs=[recv]))
    assert engine.members == {"p0@tp0.0": "prefill-a"}


def test_a_member_signing_a_handoff_that_names_another_members_sender_is_pinned_to_itself(
        cluster: Authority) -> None:
    """Mallory signs a hand-off naming prefill-a's address: the decode loads it only from
    mallory, so prefill-a's service (which proves prefill-a) is refused on the link
    (real NIXL: tests/faults/test_vllm_handoff_members.py)."""
    mallory = identity(cluster.member("mallory"))
    d = decode(cluster, identity(cluster.member("decode-0", "decode")))
    recv = loaded(d, "d0", issued(cluster, mallory, sender=A_SENDER))
    assert recv is not None and recv.handoff.member == "mallory"
    w, engine = worker(1, 0)
    w.start(Work(recvs=[recv]))
    assert engine.members == {"p0@tp0.0": "mallory"}


def test_an_altered_or_transplanted_member_proof_is_refused(cluster: Authority) -> None:
    a, mallory = identity(cluster.member("prefill-a")), identity(cluster.member("mallory"))
    key = cluster_key(cluster)
    d = decode(cluster, identity(cluster.member("decode-0", "decode")))
    genuine = issued(cluster, a, "p1")
    # a member holds the cluster's key: she re-MACs prefill-a's hand-off naming her own sender
    record = handoff_from(genuine)
    assert record is not None
    remaced = dataclasses.replace(record, senders=(M_SENDER,), mac="").signed(key)
    remaced = dataclasses.replace(remaced, proof=record.proof)
    # prefill-a's proof on a hand-off mallory issued; mallory's certificate under a's signature
    own = handoff_from(issued(cluster, mallory, "p2"))
    assert own is not None and own.proof is not None and record.proof is not None
    transplanted = dataclasses.replace(own, proof=record.proof)
    swapped = dataclasses.replace(record, proof=(own.proof[0], record.proof[1]))
    garbage = {**genuine, MEMBER_KEY: {"cert": "@@", "signature": "AA=="}}
    for rid, params in (("r1", remaced.to_params()), ("r2", transplanted.to_params()),
                        ("r3", swapped.to_params()), ("r4", garbage)):
        assert loaded(d, rid, params) is None, rid
    assert d.counts == {"handoff_identity": 4}
    assert d.build().recvs == []
    with pytest.raises(HandoffError, match="cert and signature"):
        handoff_from({**genuine, MEMBER_KEY: {"cert": "AA=="}})


def test_a_revoked_members_handoff_is_refused_once_the_list_names_it(cluster: Authority, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    files = cluster.member("mallory")
    mallory = identity(files)
    me = identity(cluster.member("decode-0", "decode"))
    crl, _ = revoke(cluster.dir, [])
    d = decode(cluster, me, revocations=RevocationWatch(crl, me.ca))
    assert loaded(d, "before", issued(cluster, mallory, "m0")) is not None
    revoke(cluster.dir, [serial_of(files["identity_cert_file"])])
    monkeypatch.setattr(scheduler, "POLL_S", 0.0)  # the next hand-off looks at the list's file
    assert loaded(d, "after", issued(cluster, mallory, "m1")) is None
    assert d.counts["handoff_revoked"] == 1
    # a list another authority signed, put in its place, is refused and the last good one kept
    other = Authority(tmp_path, "c1")
    os.replace(revoke(other.dir, [])[0], crl)
    assert loaded(d, "later", issued(cluster, mallory, "m2")) is None
    assert d.counts["revocation_list"] == 1 and d.counts["handoff_revoked"] == 2


def test_only_a_prefill_of_this_cluster_may_sign(cluster: Authority, tmp_path: Path) -> None:
    d = decode(cluster, identity(cluster.member("decode-0", "decode")))
    as_decode = issued(cluster, identity(cluster.member("decode-1", "decode")), "x0")
    stranger = Authority(tmp_path, "c1", key=cluster.key)  # the same cluster's name and key, another CA
    elsewhere = Authority(tmp_path, "c2", key=cluster.key)
    for rid, params in (("r0", as_decode), ("r1", issued(cluster, identity(stranger.member("prefill-a")), "x1")),
                        ("r2", issued(cluster, identity(elsewhere.member("prefill-a")), "x2"))):
        assert loaded(d, rid, params) is None, rid
    assert d.counts == {"handoff_identity": 3}


def test_a_handoff_without_a_member_proof_is_refused_unless_peers_without_identity_are_allowed(
        cluster: Authority) -> None:
    me = identity(cluster.member("decode-0", "decode"))
    plain = issued(cluster, None)
    strict = decode(cluster, me)
    assert loaded(strict, "d0", plain) is None
    assert strict.counts == {"handoff_identity_missing": 1}
    lenient = decode(cluster, me, allow=True)
    recv = loaded(lenient, "d0", plain)
    assert recv is not None and recv.handoff.member == ""  # loaded from whoever answers there, as before
    assert lenient.counts == {"loads": 1, "loads_without_identity": 1}


def test_a_decode_without_an_identity_takes_a_members_handoff_by_its_mac_as_before(cluster: Authority) -> None:
    d = decode(cluster, None)
    recv = loaded(d, "d0", issued(cluster, identity(cluster.member("prefill-a"))))
    assert recv is not None and recv.handoff.member == "" and d.counts == {"loads": 1}
