"""The handshake's defences from the dialer's side: a real service dials a hostile
acceptor (``tests.hostile.acceptor``), as a decode dials the prefill its request names.

Every check the acceptor makes of a dialer's Hello and proof, the dialer makes of the
acceptor's (``_control.handshakes.Handshakes.hello``); the acceptor's are tested in
test_hostile_peers.py and tests/compat/test_mixed_versions.py, these are the dialer's.
For each attack the request that dialled ends failed, with its reason and the
dialer's own words (never the library's, never empty), the original error kept, at
once (not at its deadline); the acceptor hears at most a ``Reject``, never the
dialer's proof nor its Join (its NIXL metadata); nothing stays linked or held.  An
acceptor that holds the key and proves it is held to the rest: its Join must come
sealed by this link and describe a pool and an agent that check out."""

from __future__ import annotations

import secrets
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest
import structlog

from kvservice import FailureReason, TransferService, TransferStatus
from kvservice._control.protocol import (
    PROTOCOL_VERSION,
    FrameError,
    Join,
    MemoryWire,
    Message,
    Proof,
    Reject,
    Sealed,
    encode_body,
)
from kvservice._results import AuthenticationError, ProtocolError
from tests.helpers import config, scaled
from tests.hostile import (
    Raw,
    accept_join,
    acceptor,
    answer_hello,
    fake_metadata,
    join_for,
    own_key,
    stripped,
    wire_memory,
)

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
        await raw.until_closed(got)

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
        await raw.until_closed(got)  # its Hello, then whatever else comes

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


IMPOSTOR = "kv-impostor-1"


async def _clear(raw: Raw) -> None:
    join = Join(fake_metadata(IMPOSTOR), msgspec.convert(wire_memory(), MemoryWire))
    await raw.send(Sealed(encode_body(join)))  # the box not encrypted under the link's Join key


async def _unmacked(raw: Raw) -> None:
    raw.mac = None  # sealed, but the frame carries no MAC
    await raw.send(join_for(IMPOSTOR))


def _sends(join: dict[str, Any]) -> Callable[[Raw], Awaitable[None]]:
    return lambda raw: raw.send(join)


#: attack: (what the key-holding acceptor sends for its Join, the request's reason, the error's
#: type and kind (None: not a ProtocolError), the words the request's message carries)
JOINS: dict[str, tuple[Callable[[Raw], Awaitable[None]], FailureReason, type[Exception], str | None, str]] = {
    "a join in clear": (_clear, FailureReason.PEER_LOST, FrameError, None,
                        "the join failed decryption (not sealed by this link's peer)"),
    "a join without its MAC": (_unmacked, FailureReason.PEER_LOST, FrameError, None,
                               "frame failed authentication"),
    "metadata naming another agent": (
        _sends(join_for(IMPOSTOR, metadata=fake_metadata("kv-someone-else"))),
        FailureReason.INCOMPATIBLE, ProtocolError, "metadata_mismatch",
        f"NIXL metadata names agent 'kv-someone-else', not '{IMPOSTOR}'"),
    "a pool out of range": (_sends(join_for(IMPOSTOR, memory=wire_memory(tp_size=2, tp_rank=5))),
                            FailureReason.INCOMPATIBLE, ProtocolError, "incompatible",
                            "tp_rank 5 of tp_size 2 is not a rank"),
    # what a real acceptor says when its own NIXL fails to load us (its network went down as
    # it loaded, say): a backend failure over there, not a pair that cannot work together
    "a refusal to load our agent": (
        lambda raw: raw.send(Reject("cannot load this agent into NIXL: add_remote_agent: nixlBackendError: "
                                    "NIXL_ERR_BACKEND", "nixl_refused")),
        FailureReason.BACKEND, ProtocolError, "nixl_refused", "NIXL_ERR_BACKEND"),
}


@pytest.mark.parametrize("attack", list(JOINS))
async def test_a_dialer_refuses_a_key_holding_acceptors_bad_join(attack: str) -> None:
    send_join, reason, error, kind, words = JOINS[attack]
    got: list[Message] = []

    async def serve(raw: Raw) -> None:
        await answer_hello(raw, key=own_key(), agent=IMPOSTOR)
        await accept_join(raw, key=own_key())  # the dialer's proof and Join: it believes us so far
        await send_join(raw)
        await raw.until_closed(got)

    async with acceptor(serve) as address, TransferService(config(connect_timeout_s=scaled(2.0))) as svc:
        await svc.expect("r1", [1, 2], sender=address)
        result = await svc.await_arrival("r1", timeout=GUARD_S)
        assert (result.status, result.reason) == (TransferStatus.FAILED, reason), result
        assert result.message.startswith(f"cannot reach sender {address}: ") and words in result.message, result
        assert isinstance(result.error, error), repr(result.error)
        if kind is not None:
            assert isinstance(result.error, ProtocolError) and result.error.kind == kind, repr(result.error)
        st = svc.status()
        assert st["peers"] == [] and st["live_nixl_handles"] == 0, st
    assert all(isinstance(m, Reject) for m in got), got


async def _hang_up(raw: Raw) -> None:
    await raw.recv()  # the dialer's Hello, then the connection closed


async def _reset(raw: Raw) -> None:
    await raw.recv()  # the dialer's Hello, then the connection reset (RST)
    sock = raw.stream.extra(anyio.abc.SocketAttribute.raw_socket)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("leave", [_hang_up, _reset], ids=["hangs up", "resets"])
async def test_an_acceptor_that_leaves_mid_handshake_is_named_with_a_reason(
        leave: Callable[[Raw], Awaitable[None]]) -> None:
    async with acceptor(leave) as address, TransferService(config(connect_timeout_s=GUARD_S)) as svc:
        await svc.expect("r1", [1, 2], sender=address)
        result = await svc.await_arrival("r1", timeout=GUARD_S)
        assert (result.status, result.reason) == (TransferStatus.FAILED, FailureReason.PEER_LOST), result
        assert result.message == (f"cannot reach sender {address}: {address} closed the connection during the "
                                  "handshake, before its hello"), result
        assert isinstance(result.error, ConnectionError) and isinstance(result.error.__cause__, Exception), repr(
            result.error)
