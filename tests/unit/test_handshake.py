"""The handshake's proofs and the per-frame MACs, as pure functions."""

from __future__ import annotations

import pytest

from kvservice._trust.handshake import (
    ACCEPTOR,
    DIALER,
    MAC_BYTES,
    Exchange,
    FrameMac,
    LinkSecrets,
    check_versions,
    new_nonce,
    newest_in,
    prove,
    transcript,
    verify,
)

KEY = b"k" * 32
OTHER = b"o" * 32


def script(dialer_nonce: bytes, acceptor_nonce: bytes) -> bytes:
    return transcript(("kv-d", "127.0.0.1:1", dialer_nonce), ("kv-a", "127.0.0.1:2", acceptor_nonce))


def test_a_proof_verifies_only_for_its_key_role_and_transcript() -> None:
    s = script(new_nonce(), new_nonce())
    proof = prove(KEY, ACCEPTOR, s)
    assert verify(KEY, ACCEPTOR, s, proof) is None
    assert "failed" in (verify(OTHER, ACCEPTOR, s, proof) or "")  # wrong key
    assert "failed" in (verify(KEY, DIALER, s, proof) or "")  # reflected to the other role
    assert "failed" in (verify(KEY, ACCEPTOR, script(new_nonce(), new_nonce()), proof) or "")  # replayed


def test_every_transcript_field_is_bound() -> None:
    d, a = new_nonce(), new_nonce()
    base = transcript(("kv-d", "h:1", d), ("kv-a", "h:2", a))
    variants = [
        transcript(("kv-x", "h:1", d), ("kv-a", "h:2", a)),
        transcript(("kv-d", "h:9", d), ("kv-a", "h:2", a)),
        transcript(("kv-d", "h:1", d), ("kv-x", "h:2", a)),
        transcript(("kv-d", "h:1", d), ("kv-a", "h:9", a)),
        transcript(("kv-a", "h:2", a), ("kv-d", "h:1", d)),  # roles swapped
    ]
    proof = prove(KEY, DIALER, base)
    for v in variants:
        assert verify(KEY, DIALER, v, proof) is not None


def test_keyed_and_unkeyed_refuse_each_other() -> None:
    s = script(new_nonce(), new_nonce())
    assert prove(None, DIALER, s) == b""
    assert verify(None, DIALER, s, b"") is None
    assert "has none" in (verify(None, DIALER, s, prove(KEY, DIALER, s)) or "")
    assert "did not authenticate" in (verify(KEY, DIALER, s, b"") or "")


def test_frame_macs_refuse_forgery_alteration_replay_and_reordering() -> None:
    s = script(new_nonce(), new_nonce())
    tx, rx = FrameMac(KEY, s, DIALER), FrameMac(KEY, s, ACCEPTOR)
    one, two = tx.seal(b"first"), tx.seal(b"second")
    assert len(one) == len(b"first") + MAC_BYTES
    assert rx.open(two) is None  # out of order
    assert rx.open(one) == b"first"
    assert rx.open(one) is None  # replayed
    assert rx.open(b"X" + two[1:]) is None  # altered
    assert rx.open(two) == b"second"
    assert rx.open(b"short") is None
    # the other direction has its own key: a frame cannot be reflected back
    back = FrameMac(KEY, s, ACCEPTOR).seal(b"reply")
    assert FrameMac(KEY, s, ACCEPTOR).open(back) is None
    assert FrameMac(KEY, s, DIALER).open(back) == b"reply"
    # another connection (other nonces) shares no key
    assert FrameMac(KEY, script(new_nonce(), new_nonce()), ACCEPTOR).open(FrameMac(KEY, s, DIALER).seal(b"x")) is None


@pytest.mark.parametrize("n", [0, 1, 31])
def test_nonces_are_fresh_and_32_bytes(n: int) -> None:
    assert len(new_nonce()) == 32
    assert new_nonce() != new_nonce()


# -- versions and the key exchange (protocol version 6) ------------------------------------------


def test_a_nonce_carries_its_senders_newest_version_and_a_random_one_none() -> None:
    assert newest_in(new_nonce(6)) == 6 and newest_in(new_nonce(65535)) == 65535
    assert newest_in(new_nonce()) is None  # version 5's: random throughout
    assert len(new_nonce(6)) == 32 and new_nonce(6) != new_nonce(6)


def test_versions_lowered_on_the_path_are_caught_by_the_nonce() -> None:
    assert check_versions(new_nonce(6), ours=6, agreed=6) is None
    assert check_versions(new_nonce(), ours=6, agreed=5) is None  # a peer of version 5
    assert check_versions(new_nonce(7), ours=6, agreed=6) is None  # a newer peer, our newest
    assert "tampered" in (check_versions(new_nonce(6), ours=6, agreed=5) or "")  # stripped on the path


def test_the_exchange_gives_both_sides_one_secret_and_refuses_what_is_not_a_key() -> None:
    a, b = Exchange(), Exchange()
    assert a.shared(b.share) == b.shared(a.share) and len(a.share) == 32
    for bad in (b"", b"\x01" * 31):
        with pytest.raises(ValueError, match=f"key exchange: a public key of {len(bad)} bytes, not 32"):
            a.shared(bad)
    # points of small order (0, 1 and the order-8 point, RFC 7748's test vectors' kind): the
    # shared secret would be all zero; said in kvservice's words, the library's kept as the cause
    order8 = bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800")
    for bad in (bytes(32), (1).to_bytes(32, "little"), order8):
        with pytest.raises(ValueError) as caught:
            a.shared(bad)
        assert str(caught.value).startswith("key exchange: the peer's public key is a point of small order")
        assert isinstance(caught.value.__cause__, ValueError)


def test_link_secrets_with_an_exchange_differ_from_the_transcripts_alone() -> None:
    s = script(new_nonce(6), new_nonce(6))
    shared = Exchange().shared(Exchange().share)
    plain, exchanged = LinkSecrets(KEY, s, DIALER), LinkSecrets(KEY, s, DIALER, shared=shared)
    assert plain.notif_out != exchanged.notif_out
    peer = LinkSecrets(KEY, s, ACCEPTOR, shared=shared)
    assert peer.open_join(exchanged.seal_join(b"metadata")) == b"metadata"
    assert LinkSecrets(KEY, s, ACCEPTOR).open_join(exchanged.seal_join(b"metadata")) is None
    unkeyed = LinkSecrets(None, s, DIALER, shared=shared)
    assert unkeyed.notif_out not in (LinkSecrets(None, s, DIALER).notif_out, exchanged.notif_out)
