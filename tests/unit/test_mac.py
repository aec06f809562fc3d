"""``_trust.mac``: the kept-block HMAC gives ``hmac.digest``'s tags exactly, for every key
length (shorter than, equal to and longer than SHA-256's block), and its table of kept keys
stays bounded however many keys pass through it."""

from __future__ import annotations

import hmac
import os

import pytest

from kvservice._trust import mac
from kvservice._trust.mac import HmacSha256, hmac_sha256


@pytest.mark.parametrize("key_len", [0, 1, 16, 32, 63, 64, 65, 128, 1000])
@pytest.mark.parametrize("msg_len", [0, 1, 55, 56, 64, 80, 1000])
def test_tags_are_hmac_sha256s(key_len: int, msg_len: int) -> None:
    key, msg = os.urandom(key_len), os.urandom(msg_len)
    want = hmac.digest(key, msg, "sha256")
    assert HmacSha256(key).digest(msg) == want
    assert hmac_sha256(key, msg) == want
    assert hmac_sha256(key, msg) == want  # the kept blocks, again: copied per message, not consumed


def test_one_key_many_messages_and_a_wrong_key() -> None:
    key = os.urandom(32)
    keyed = HmacSha256(key)
    for i in range(50):
        msg = i.to_bytes(8, "big") * i
        assert keyed.digest(msg) == hmac.digest(key, msg, "sha256")
    assert HmacSha256(os.urandom(32)).digest(b"x") != keyed.digest(b"x")
    assert HmacSha256(key + b"\0").digest(b"x") == keyed.digest(b"x")  # RFC 2104 pads with zeros, as hmac does


def test_the_kept_keys_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mac, "KEPT_KEYS", 8)
    monkeypatch.setattr(mac, "_kept", {})
    keys = [os.urandom(32) for _ in range(30)]
    for key in keys:
        assert hmac_sha256(key, b"body") == hmac.digest(key, b"body", "sha256")
        assert len(mac._kept) <= 8
    assert hmac_sha256(keys[0], b"body") == hmac.digest(keys[0], b"body", "sha256")  # dropped, made again
