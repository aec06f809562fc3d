"""The handshake's defences from the dialer's side: a real service dials a hostile
acceptor (``tests.hostile.acceptor``), as a decode dials the prefill its request names.

Every check the acceptor makes of a dialer's Hello and proof, the dialer makes of the
acceptor's (``_control.handshakes.Handshakes.hello``); the acceptor's are tested in
test_hostile_peers.py and tests/compat/test_mixed_versions.py, these are the dialer's.
For each attack the request that dialled ends failed, with its reason and the
dialer's own words (never the library's, never empty), the original error kept, at
once (not at its deadline); the acceptor hears at most a ``Reject``, never the
dialer's proof nor its Join (its NIXL metadata); nothing stays linked or held."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
import structlog

from kvservice import FailureReason, TransferService, TransferStatus
from kvservice._control.protocol import PROTOCOL_VERSION, Message, Proof, Reject, Sealed
from kvservice._results import AuthenticationError, ProtocolError
from tests.helpers import config, scaled
from tests.hostile import Raw, acceptor, answer_hello, own_key, stripped

pytestmark = pytest.mark.nixl

GUARD_S = scaled(30.0)  # a hang guard for each wait, never a timed assertion
OWN, WRONG, NONE = "own", "wrong", "none"  # the key the acceptor proves with
SELF = "kv-the-dialer"  # stands for the dialing service's own agent name

TAMPERED = (f"the handshake was tampered with: the peer speaks up to protocol version {PROTOCOL_VERSION}, "
            "yet version 5 was agreed")

#: attack: (the acceptor's Hello fields, its key, the request's reason, the error's kind, the words
#: the request's message carries, whether the dialer tells the acceptor why)
ATTACKS: dict[str, tuple[dict[str, Any], str, FailureReason, str, str, bool]] = {
    # an acceptor of this release that says it speaks version 5 only: a link without
    # forward secrecy, which its own nonce (covered by its proof) gives away
    "top stripped": (stripped(), OWN, FailureReason.REFUSED, "auth", TAMPERED, True),
    "top lowered": (stripped(top=5), OWN, FailureReason.REFUSED, "auth", TAMPERED, True),
    "wrong key": ({}, WRONG, FailureReason.REFUSED, "auth",
                  "authentication failed (wrong key, or a replayed handshake)", True),
    "no key": ({}, NONE, FailureReason.REFUSED, "auth", "the peer did not authenticate (no key configured there)",
               True),
    "small-order share": ({"share": bytes(32)}, OWN, FailureReason.INCOMPATIBLE, "hello_invalid",
                          "key exchange: the peer's public key is a point of small order", False),
    "short nonce": ({"nonce": b"\x01" * 16}, OWN, FailureReason.INCOMPATIBLE, "hello_invalid",
                    "nonce must be 32 bytes, got 16", False),
    "bad agent name": ({"agent": "bad name!"}, OWN, FailureReason.INCOMPATIBLE, "hello_invalid",
                       "agent name 'bad name!' is not 1-128 of [A-Za-z0-9._-]", False),
    "the dialer's own name": ({"agent": SELF}, OWN, FailureReason.INCOMPATIBLE, "hello_invalid",
                              "a service cannot peer with itself", False),
    "unspecified address": ({"address": "0.0.0.0:7100"}, OWN, FailureReason.INCOMPATIBLE, "hello_invalid",
                            "advertised address '0.0.0.0:7100' cannot be dialled", False),
    "versions that do not meet": ({"version": PROTOCOL_VERSION + 1, "top": PROTOCOL_VERSION + 1}, OWN,
                                  FailureReason.INCOMPATIBLE, "version",
                                  f"the peer speaks protocol version {PROTOCOL_VERSION + 1}", False),
}


def _key(which: str) -> bytes | None:
    return {OWN: own_key(), WRONG: secrets.token_bytes(32), NONE: None}[which]


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_a_dialer_refuses_a_hostile_acceptor_and_sends_it_nothing(attack: str) -> None:
    fields, key, reason, kind, words, told = ATTACKS[attack]
    got: list[Message] = []

    async def serve(raw: Raw) -> None:
        own = {k: svc.agent_name if v == SELF else v for k, v in fields.items()}
        await answer_hello(raw, key=_key(key), hello=own)
        got.extend(await raw.until_closed())

    with structlog.testing.capture_logs() as logs:
        async with acceptor(serve) as address, TransferService(config(connect_timeout_s=scaled(2.0))) as svc:
            await svc.expect("r1", [1, 2], sender=address)
            result = await svc.await_arrival("r1", timeout=GUARD_S)
            assert (result.status, result.reason) == (TransferStatus.FAILED, reason), result
            assert result.message.startswith(f"cannot reach sender {address}: ") and words in result.message, result
            assert isinstance(result.error, ProtocolError) and result.error.kind == kind, repr(result.error)
            if kind == "auth":
                assert isinstance(result.error, AuthenticationError)
            st = svc.status()
            assert st["peers"] == [] and st["live_nixl_handles"] == 0, st
    # the acceptor heard why (a refused proof), or nothing at all; never our proof or Join
    assert not any(isinstance(m, Proof | Sealed) for m in got), got
    if told:
        assert len(got) == 1 and isinstance(got[0], Reject) and got[0].kind == "auth", got
        assert words in got[0].message, got
    else:
        assert got == [], got
    failed = [e for e in logs if e["event"] == "peer.dial_failed"]
    assert len(failed) == 1 and failed[0]["kind"] == kind and words in failed[0]["error"], failed


async def test_a_dial_that_times_out_says_so() -> None:
    """An acceptor that takes the connection and the dialer's Hello, then says nothing
    (as a SIGSTOPped one does): the request fails at the handshake's deadline with a
    reason in kvservice's words (TimeoutError's own is empty), and the acceptor never
    hears the dialer's proof."""
    got: list[Message] = []

    async def silent(raw: Raw) -> None:
        got.extend(await raw.until_closed())  # its Hello, then whatever else comes

    limit = scaled(1.0)
    with structlog.testing.capture_logs() as logs:
        async with acceptor(silent) as address, TransferService(config(connect_timeout_s=limit)) as svc:
            await svc.expect("r1", [1, 2], sender=address)
            result = await svc.await_arrival("r1", timeout=GUARD_S)
            assert (result.status, result.reason) == (TransferStatus.FAILED, FailureReason.PEER_LOST), result
            assert result.message == (f"cannot reach sender {address}: the handshake with {address} did not "
                                      f"complete within connect_timeout_s ({limit:g} s)"), result
            assert isinstance(result.error, TimeoutError), repr(result.error)
            st = svc.status()
            assert st["peers"] == [] and st["live_nixl_handles"] == 0, st
    assert [type(m).__name__ for m in got] == ["Hello"], got
    failed = [e for e in logs if e["event"] == "peer.dial_failed"]
    assert len(failed) == 1 and "did not complete within connect_timeout_s" in failed[0]["error"], failed
