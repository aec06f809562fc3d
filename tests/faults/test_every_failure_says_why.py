"""Every failure says why, on every path, every time: receivers SIGKILLed under many
requests in flight.

A live sender (this process) and a receiver process that expects ``REQUESTS``
requests of ``CHUNKS`` one-page chunks each.  The sender sends the chunks, and the
receiver is SIGKILLed at a different moment each round: before the first chunk, in
the middle of the posts, after the last.  Each of the sender's requests then ends by
whichever path reaches it first: the link's loss, a chunk whose post or check NIXL
failed, a send made after the loss (the Expect dropped with the link), a drain, or a
success.  Every failed result must say why by itself: a reason, a message, the
original error where one exists (a lost link's, NIXL's), and a ``failure_exception()``
whose text names all of it.  Rounds go on (bounded) until each path that can fail a
request has been seen; nothing may hang and no NIXL handle may stay live.
"""

from __future__ import annotations

import collections
import signal

import anyio
import anyio.lowlevel
import pytest

from kvservice import FailureReason, KVLayout, TransferFailed, TransferResult, TransferService
from kvservice.testing import PeerProcess
from tests.helpers import config, eventually, peer_config, peers, scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

REQUESTS = 200
CHUNKS = 4
#: 16 KiB pages, enough for every request's pages on both sides
LAYOUT = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16", num_pages=REQUESTS * CHUNKS)
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
FAST = {"heartbeat_interval_s": 0.2, "peer_timeout_s": scaled(1.0), "connect_timeout_s": 30.0}
#: the chunk sent (of REQUESTS * CHUNKS, in sending order) just before each round's SIGKILL;
#: LOST_FIRST: killed, and the first send made as soon as its link has left the peer table
LOST_FIRST = -1
KILL_AT = [LOST_FIRST, REQUESTS * CHUNKS // 2, 0, LOST_FIRST, REQUESTS * CHUNKS, 1, LOST_FIRST, REQUESTS - 1,
           3 * REQUESTS + 7, LOST_FIRST, REQUESTS * CHUNKS - 1]
#: the paths that fail a sender's request when its receiver dies, each seen at least once: its
#: link's loss, a chunk NIXL failed, a send after the loss (its Expect dropped with the link) and
#: a send that met its Expect while the loss was being handled
PATHS = {"link lost", "chunk failed", "expect dropped", "lost while binding"}
GUARD_S = 60.0  # hang guard per round: far above the loss's detection, far below any deadline


def path_of(result: TransferResult) -> str:
    """Which path ended a request, by what its failure says."""
    if result.ok:
        return "success"
    if result.message.startswith("lost peer"):
        return "link lost"
    if result.message.startswith(("make_prepped_xfer:", "transfer:", "check_xfer_state:")):
        return "chunk failed"
    if "expect was dropped" in result.message:
        return "expect dropped"
    if "lost before the request was bound" in result.message:
        return "lost while binding"
    return f"other: {result.reason} {result.message[:60]}"


def says_why(result: TransferResult, failure: TransferFailed) -> None:
    assert result.reason is not None and result.message.strip(), result
    text = str(failure)
    assert text.startswith(f"request {result.request_id!r} failed {result.reason.value} (peer "), text
    assert result.message.rstrip().removesuffix(":")[:40] in text, (result, text)
    assert failure.__cause__ is result.error, (failure, result)
    # every path here has an original error (the lost link's, NIXL's): it is kept, and told
    assert result.error is not None, result
    said = str(result.error)
    assert (said and said in text) or type(result.error).__name__ in text, text


async def one_round(svc: TransferService, child: PeerProcess, n: int, kill_at: int) -> list[TransferResult]:
    rids = [f"r{n}-{i}" for i in range(REQUESTS)]
    for i, rid in enumerate(rids):
        await child.command(op="expect", rid=rid, pages=list(range(CHUNKS * i, CHUNKS * (i + 1))), sender=svc.address)
    for rid in rids:
        await eventually(lambda: svc.expected(rid), GUARD_S, what=f"{rid}'s expect")  # noqa: B023  # awaited here
    if kill_at == LOST_FIRST:  # the sends meet their Expects while the loss is handled, or after
        child.signal(signal.SIGKILL)
        with anyio.fail_after(GUARD_S):
            while svc.status()["peers"]:
                await anyio.lowlevel.checkpoint()
    handles = {}
    sent = 0
    for c in range(CHUNKS):
        for i, rid in enumerate(rids):
            if sent == kill_at:
                child.signal(signal.SIGKILL)
            handles[rid] = await svc.send(rid, [CHUNKS * i + c], last=c == CHUNKS - 1)
            sent += 1
            if sent % 16 == 0:
                await anyio.lowlevel.checkpoint()  # let the watchdog post and the link's loss arrive mid-way
    if sent == kill_at:
        child.signal(signal.SIGKILL)
    with anyio.fail_after(GUARD_S):
        return [await svc.await_completion(handles[rid]) for rid in rids]


async def test_every_failure_of_a_killed_receivers_requests_says_why() -> None:
    seen: collections.Counter[str] = collections.Counter()
    async with TransferService(config(LAYOUT, ucx_env=TCP, bootstrap_timeout_s=120, **FAST)) as svc:
        for n, kill_at in enumerate(KILL_AT):
            async with peers(peer_config(LAYOUT, ucx_env=TCP, **FAST), env=TCP) as (child,):
                results = await one_round(svc, child, n, kill_at)
            for result in results:
                seen[path_of(result)] += 1
                if result.ok:
                    continue
                with pytest.raises(TransferFailed) as raised:
                    result.raise_for_failure()
                says_why(result, raised.value)
                assert result.reason in (FailureReason.PEER_LOST, FailureReason.REMOTE_DISCONNECT,
                                         FailureReason.BACKEND), result
            await eventually(lambda: svc.status()["live_nixl_handles"] == 0, GUARD_S, what="no live handle")
            if PATHS <= seen.keys():
                break
        print(f"\npaths seen over {n + 1} rounds: {dict(seen)}")
        assert not [p for p in seen if p.startswith("other")], seen
        assert PATHS <= seen.keys(), seen
