"""Every way a peer is lost ends in an exception that says why by itself.

Schedulers log only ``str()`` of what ``failure_exception()`` raises (SGLang's
"Prefill transfer failed ... with exception {e}"), and the transport's own error is
often silent: anyio's ``BrokenResourceError()`` of a link cut by a SIGKILL, the
``TimeoutError()`` of a handshake nobody answers.  So each test here makes a peer go
away for real (a child service SIGKILLed, SIGSTOPped then SIGKILLed; an address where
nobody listens; a listener that accepts and says nothing) and checks what
``failure_exception()`` (sender) and ``raise_for_failure()`` (receiver) raise: a
``TransferFailed`` whose message names the request, the reason and the peer, with the
original error as its ``__cause__``.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest

from kvservice import FailureReason, KVPoll, TransferFailed, TransferResult, TransferService
from kvservice.testing import PeerProcess
from tests.helpers import config, eventually, free_port, peer_config, peers, scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

#: fast loss detection, so that a stopped peer is declared lost well inside the hang guards,
#: yet as long as this run's machine needs (on a loaded one a live child's heartbeats came 1-2.5 s
#: apart and its link, with the expect the test waits for, was lost before the test began);
#: a patient first dial (a handshake on a busy 2-core machine can take seconds)
FAST = {"heartbeat_interval_s": 0.2, "peer_timeout_s": scaled(1.0), "connect_timeout_s": 30.0}
GUARD_S = 20.0  # hang guard: far above FAST's detection, far below any request deadline


def says_why(raised: TransferFailed, result: TransferResult, reason: FailureReason, *peer_names: str) -> None:
    """The message alone says which request, why, and with whom; the original is the cause."""
    text = str(raised)
    assert text.startswith(f"request {result.request_id!r} failed {reason.value} ("), text
    assert raised.reason is reason and raised.request_id == result.request_id and raised.result is result
    for name in peer_names:
        assert name in text, (name, text)
    assert raised.peer == result.peer and raised.peer, text
    assert result.error is not None and raised.__cause__ is result.error, (text, result.error)
    said = str(result.error)  # the original is described, even when its own message is empty
    assert (said and said in text) or type(result.error).__name__ in text, text


@asynccontextmanager
async def silent_listener() -> AsyncIterator[str]:
    """An address that accepts TCP connections and never says a word on them."""
    async def hold(stream: anyio.abc.SocketStream) -> None:
        async with stream:  # closed when the listener's task group is cancelled
            await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:  # the serving task ends first
        tg.start_soon(listener.serve, hold)
        yield f"127.0.0.1:{port}"
        tg.cancel_scope.cancel()


def sigkill(child: PeerProcess) -> None:
    child.signal(signal.SIGKILL)


async def sigstop_then_sigkill(child: PeerProcess) -> None:
    """A peer that stalls briefly (not long enough to be declared lost), then is killed."""
    child.signal(signal.SIGSTOP)
    await anyio.sleep(FAST["heartbeat_interval_s"])
    child.signal(signal.SIGKILL)


async def lose(child: PeerProcess, how: str) -> None:
    if how == "sigkill":
        sigkill(child)
    else:
        await sigstop_then_sigkill(child)


HOW = ["sigkill", "sigstop_then_sigkill"]


@pytest.mark.parametrize("how", HOW)
async def test_a_lost_receiver_fails_the_sender_saying_why(how: str) -> None:
    """A bound request (its first chunk landed, the last not sent yet) whose receiver dies."""
    async with peers(peer_config(**FAST)) as (child,), TransferService(config(**FAST)) as svc:
        await child.command(op="expect", rid="s1", pages=[5, 6, 7], sender=svc.address)
        await child.event("expecting", "s1", timeout=GUARD_S)
        await eventually(lambda: svc.expected("s1"), GUARD_S)
        handle = await svc.send("s1", [1], last=False)
        await eventually(lambda: handle.poll() is KVPoll.WaitingForInput, GUARD_S)
        await lose(child, how)
        with anyio.fail_after(GUARD_S):
            result = await svc.await_completion(handle)
        assert result.reason is FailureReason.PEER_LOST, result
        with pytest.raises(TransferFailed) as raised:
            handle.failure_exception()
        # a receiver it was not pinned to is named by the address it was proven at
        says_why(raised.value, result, FailureReason.PEER_LOST, child.address)
        assert result.peer == child.address, result


@pytest.mark.parametrize("how", HOW)
async def test_a_lost_sender_fails_the_receiver_saying_why(how: str) -> None:
    """An expect sent to a live sender that then dies before sending anything."""
    async with peers(peer_config(**FAST)) as (child,), TransferService(config(**FAST)) as svc:
        await svc.expect("r1", [3, 4], sender=child.address)
        assert svc.poll_arrival("r1") is KVPoll.WaitingForInput  # linked: the expect went out
        await lose(child, how)
        with anyio.fail_after(GUARD_S):
            result = await svc.await_arrival("r1")
        assert result.reason is FailureReason.PEER_LOST, result
        with pytest.raises(TransferFailed) as raised:
            result.raise_for_failure()
        says_why(raised.value, result, FailureReason.PEER_LOST, child.address)
        assert result.peer == child.address


async def test_a_refused_dial_says_who_refused() -> None:
    """Nobody listens at the sender's address: the dial's ``ConnectionRefusedError``."""
    nobody = f"127.0.0.1:{free_port()}"
    async with TransferService(config()) as svc:
        await svc.expect("refused", [1], sender=nobody)
        result = await svc.await_arrival("refused", timeout=GUARD_S)
        with pytest.raises(TransferFailed) as raised:
            result.raise_for_failure()
    says_why(raised.value, result, FailureReason.PEER_LOST, nobody)
    assert isinstance(raised.value.__cause__, OSError), repr(raised.value.__cause__)


async def test_a_handshake_nobody_answers_says_it_timed_out() -> None:
    """A sender's address that accepts TCP and says nothing: the dial gives up after
    ``connect_timeout_s`` with a ``TimeoutError`` that names what ran out."""
    async with silent_listener() as silent, TransferService(config(connect_timeout_s=0.5)) as svc:
        await svc.expect("mute", [1], sender=silent)
        result = await svc.await_arrival("mute", timeout=GUARD_S)
        with pytest.raises(TransferFailed) as raised:
            result.raise_for_failure()
    says_why(raised.value, result, FailureReason.PEER_LOST, silent)
    assert isinstance(raised.value.__cause__, TimeoutError) and "connect_timeout_s" in str(raised.value.__cause__)

