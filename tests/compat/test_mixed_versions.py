"""The previous release and this one in one cluster, as a rolling upgrade has them.

The previous release (``previous.PREVIOUS``: control protocol 5) runs in child processes
from its own tree; this checkout's code runs in the test's process or in children of its
own.  Each direction moves bytes that are verified page by page, a restart of either side
under traffic fails only what was in flight with it (``PEER_LOST``) and the next
incarnation links again, and ``status()["peer_versions"]`` proves which version each link
speaks (a link of version 5 exists only with a peer of the previous release).
"""

from __future__ import annotations

import signal

import anyio
import pytest
import torch

from kvservice import FailureReason, TransferService, TransferStatus
from kvservice._control.protocol import OLDEST_VERSION, PROTOCOL_VERSION, Hello
from kvservice.testing import PeerProcess, pattern
from tests.compat.previous import PREVIOUS_PROTOCOL, previous_env
from tests.helpers import READY_S, SMALL, config, eventually, free_port, peer_config, peers, scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

#: generous bounds for one step on a loaded machine (never a speed assertion)
GUARD_S = scaled(30.0)


@pytest.fixture(scope="module")
def old() -> dict[str, str]:
    """The previous release's environment (its tree unpacked once)."""
    return previous_env()


def test_the_policy_reaches_back_to_the_previous_release() -> None:
    assert OLDEST_VERSION <= PREVIOUS_PROTOCOL < PROTOCOL_VERSION


async def send_to(svc: TransferService, decode: PeerProcess, rid: str, src: list[int], dst: list[int]) -> None:
    """``svc`` sends ``rid`` to the peer process ``decode``, which verifies every byte."""
    svc.kv.write(src, pattern(SMALL, rid, len(src)))
    await decode.command(op="expect", rid=rid, pages=dst, sender=svc.address)
    await decode.event("expecting", rid, timeout=GUARD_S)
    result = await svc.await_completion(await svc.send(rid, src, last=True), timeout=GUARD_S)
    assert result.status is TransferStatus.SUCCESS, result
    arrived = await decode.event("arrived", rid, timeout=GUARD_S)
    assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived


async def receive_from(svc: TransferService, prefill: PeerProcess, rid: str, src: list[int], dst: list[int]) -> None:
    """The peer process ``prefill`` sends ``rid`` to ``svc``; every byte checked here."""
    await prefill.command(op="fill", rid=rid, pages=src)
    await prefill.event("filled", timeout=GUARD_S)
    await svc.expect(rid, dst, sender=prefill.address)
    await prefill.command(op="send", rid=rid, pages=src, last=True)
    result = await svc.await_arrival(rid, timeout=GUARD_S)
    assert result.ok, result
    assert torch.equal(svc.kv.pages(dst), pattern(SMALL, rid, len(dst)))
    assert (await prefill.event("completed", rid, timeout=GUARD_S))["status"] == "SUCCESS"


async def test_this_release_sends_to_the_previous_one(old: dict[str, str]) -> None:
    # the service first: a service answers its first dial once its vetting child is up (seconds
    # on a loaded machine): the dialling decode waits for that, not the default 5 s
    async with TransferService(config()) as svc, \
            peers(peer_config(connect_timeout_s=GUARD_S), env=old) as (decode,):
        await send_to(svc, decode, "up-1", [3, 4, 5, 9], [40, 41, 50, 2])  # the old decode dials us
        assert svc.status()["peer_versions"] == {str(PREVIOUS_PROTOCOL): 1}
        await send_to(svc, decode, "up-2", [10, 11], [12, 13])
        assert svc.status()["live_nixl_handles"] == 0


async def test_the_previous_release_sends_to_this_one(old: dict[str, str]) -> None:
    async with peers(peer_config(), env=old) as (prefill,), \
            TransferService(config(connect_timeout_s=GUARD_S)) as svc:  # as the restart's decode
        await receive_from(svc, prefill, "down-1", list(range(10, 22)), list(range(30, 42)))  # we dial it
        assert svc.status()["peer_versions"] == {str(PREVIOUS_PROTOCOL): 1}
        await receive_from(svc, prefill, "down-2", [1], [63])
        assert svc.status()["unsettled_pages"] == 0


async def test_two_peers_of_this_release_speak_its_version() -> None:
    async with peers(peer_config()) as (decode,), TransferService(config()) as svc:
        await send_to(svc, decode, "same-1", [3], [4])
        assert svc.status()["peer_versions"] == {str(PROTOCOL_VERSION): 1}


@pytest.mark.parametrize("restart", ["previous", "this"])
async def test_a_restart_under_traffic_across_versions(old: dict[str, str], restart: str) -> None:
    """An old prefill sends to a new decode (each in its own process) while one of them
    is replaced in place (SIGKILL, started again on its port): what was in flight fails
    ``PEER_LOST`` on the survivor, nothing hangs, and the next incarnation moves bytes
    again, verified, over a link of version 5."""
    # A service restarted in place answers its first dial once its vetting child is up
    # (seconds on a loaded machine): the dialling decode waits for that, not the default 5 s.
    prefill_cfg = peer_config(port=free_port())
    decode_cfg = peer_config(port=free_port(), connect_timeout_s=GUARD_S)
    async with anyio.create_task_group() as tg:
        prefill = await PeerProcess.start(tg, prefill_cfg, env=old, ready_timeout=READY_S)
        decode = await PeerProcess.start(tg, decode_cfg, ready_timeout=READY_S)
        try:
            async def one(rid: str, src: list[int], dst: list[int]) -> None:
                await prefill.command(op="fill", rid=rid, pages=src)
                await prefill.event("filled", timeout=GUARD_S)
                await decode.command(op="expect", rid=rid, pages=dst, sender=prefill.address, timeout=GUARD_S)
                await decode.event("expecting", rid, timeout=GUARD_S)
                await prefill.command(op="send", rid=rid, pages=src, last=True)

            async def verified(rid: str) -> None:
                arrived = await decode.event("arrived", rid, timeout=GUARD_S)
                assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived
                assert (await prefill.event("completed", rid, timeout=GUARD_S))["status"] == "SUCCESS"

            for i in range(3):  # traffic before the restart
                await one(f"before-{i}", [i], [10 + i])
                await verified(f"before-{i}")
            # in flight at the restart: the decode expects it, the prefill sent part of it
            await prefill.command(op="fill", rid="inflight", pages=[20, 21])
            await prefill.event("filled", timeout=GUARD_S)
            await decode.command(op="expect", rid="inflight", pages=[30, 31], sender=prefill.address,
                                 timeout=GUARD_S)
            await decode.event("expecting", "inflight", timeout=GUARD_S)
            await prefill.command(op="send", rid="inflight", pages=[20], last=False)
            survivor = decode if restart == "previous" else prefill
            victim_cfg, env = (prefill_cfg, old) if restart == "previous" else (decode_cfg, None)
            victim = prefill if restart == "previous" else decode
            victim.signal(signal.SIGKILL)
            await victim.stop(timeout=GUARD_S)
            if survivor is decode:
                lost = await decode.event("arrived", "inflight", timeout=GUARD_S)
            else:  # a sender's part-sent request: its result once settled
                await prefill.command(op="await_settled", rid="inflight", timeout=GUARD_S)
                lost = await prefill.event("settled", "inflight", timeout=GUARD_S)
            # the sender may learn it from NIXL first (its WRITE to a dead endpoint)
            died = {FailureReason.PEER_LOST.value, FailureReason.REMOTE_DISCONNECT.value}
            assert lost["status"] == "FAILED" and lost["reason"] in died, lost
            reborn = await PeerProcess.start(tg, victim_cfg, env=env, ready_timeout=READY_S)
            prefill, decode = (reborn, decode) if restart == "previous" else (prefill, reborn)
            for i in range(3):  # the next incarnation links again, across the versions
                await one(f"after-{i}", [40 + i], [50 + i])
                await verified(f"after-{i}")
            await decode.command(op="status")
            status = await decode.event("status", timeout=GUARD_S)
            assert status["peer_versions"] == {str(PREVIOUS_PROTOCOL): 1}, status
        finally:
            with anyio.CancelScope(shield=True):
                for p in (prefill, decode):
                    await p.stop(timeout=10)
            tg.cancel_scope.cancel()


async def test_a_range_that_does_not_meet_is_refused_by_name() -> None:
    """A peer whose versions this release no longer speaks is refused with a ``version``
    Reject naming both ranges, counted, and a legitimate link beside it works."""
    from tests.hostile import dial, is_reject

    async with TransferService(config()) as svc, peers(peer_config()) as (decode,):
        await send_to(svc, decode, "before", [1], [2])
        raw, answer, _ = await dial(svc.address, hello={"version": OLDEST_VERSION - 1, "top": OLDEST_VERSION - 1})
        try:
            assert is_reject(answer, "version"), answer
            assert f"{OLDEST_VERSION}-{PROTOCOL_VERSION}" in answer.message  # type: ignore[union-attr]
        finally:
            await raw.aclose()
        await eventually(lambda: svc.status()["refused"].get("version") == 1, timeout=GUARD_S,
                         what="the refusal counted")
        await send_to(svc, decode, "after", [3], [4])


async def test_versions_stripped_on_the_path_are_refused() -> None:
    """A party on the path strips ``top`` from both Hellos, so that two peers of this
    release agree on version 5 (and its secrets without the key exchange): their proofs
    over version 5's transcript check out, but the dialer's nonce says it speaks 6, so the
    acceptor refuses (``auth``, "tampered"), counted, and links beside it still work."""
    from kvservice._control.protocol import Proof
    from kvservice._trust.handshake import DIALER, new_nonce, prove, transcript
    from tests.hostile import Raw, is_reject, own_key

    async with TransferService(config()) as svc, peers(peer_config()) as (decode,):
        await send_to(svc, decode, "before", [1], [2])
        raw = await Raw.connect(svc.address)
        try:
            nonce = new_nonce(PROTOCOL_VERSION)  # this release's nonce, its Hello stripped of ``top``
            agent, address = "kv-stripped", "127.0.0.1:1"
            await raw.send({"type": "hello", "version": OLDEST_VERSION, "agent": agent, "address": address,
                            "nonce": nonce})
            answer = await raw.recv()
            assert isinstance(answer, Hello) and answer.newest == PROTOCOL_VERSION, answer
            script = transcript((agent, address, nonce), (answer.agent, answer.address, answer.nonce))
            await raw.send(Proof(prove(own_key(), DIALER, script)))  # version 5's proof: it checks out
            refusal = await raw.recv()
            assert is_reject(refusal, "auth") and "tampered" in refusal.message, refusal  # type: ignore[union-attr]
        finally:
            await raw.aclose()
        await eventually(lambda: svc.status()["refused"].get("auth") == 1, timeout=GUARD_S,
                         what="the refusal counted")
        await send_to(svc, decode, "after", [3], [4])

