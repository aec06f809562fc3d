"""The handshake's proofs and the per-frame MACs, as pure functions."""

from __future__ import annotations

import pytest

from kvservice._trust.handshake import ACCEPTOR, DIALER, MAC_BYTES, FrameMac, new_nonce, prove, transcript, verify

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
