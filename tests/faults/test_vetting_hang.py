"""A vetting child that hangs is replaced, and the metadata it hung on is vetted again.

A trial load has its own deadline (``load_timeout_s``, 10 s), longer than a handshake's
(``connect_timeout_s``, 5 s by default).  The deadline ran in the handshake's scope, so a
handshake given up first took it along: a hung child was never killed, and every later first
link waited on it until its own handshake gave up; no new peer linked until the service
restarted.  And a hang that did reach the deadline remembered the metadata it was on as
unsafe for good, though a stopped or starved child hangs on honest metadata as well.

Here the child is stopped (SIGSTOP) with a real service in this process and a real decode
linked to it, and a new agent (the real metadata of a live NIXL agent) joins: once with a
deadline longer than its handshake's, once shorter.  Either way the child is killed at its
deadline and replaced, the same metadata then loads, the linked decode's transfers pass
byte-exact throughout, and the service's loop was never held up.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest

from kvservice import TransferService
from kvservice._control.protocol import Join, Message, Reject
from kvservice._trust.vetting import MetadataVetter
from kvservice.testing.inspect import inside
from tests.faults.test_hostile_peers import legit_transfer
from tests.faults.test_metadata_fuzz import ATTACKER, MEMORY, donor, donor_name, gone, renamed
from tests.helpers import Ticker, config, eventually, peer_config, peers
from tests.hostile import authenticate, join_for, own_key

pytestmark = pytest.mark.nixl

#: bound on the waits for a replacement child (its start: seconds on a loaded machine)
REPLACED_S = 90.0
_ports = itertools.count(22000)


async def join(svc: TransferService, agent: str, metadata: bytes, wait: float) -> Message | None:
    """A new peer ``agent`` joins ``svc`` with ``metadata``; its answer within ``wait`` s
    (None: the connection closed without one)."""
    raw = await authenticate(svc.address, key=own_key(), agent=agent, my_address=f"127.0.0.1:{next(_ports)}",
                             source=ATTACKER)
    try:
        await raw.send(join_for(agent, metadata=metadata, memory=MEMORY or None))
        return await raw.recv(timeout=wait)
    finally:
        await raw.aclose()


@contextmanager
def stopped(vetter: MetadataVetter) -> Iterator[int]:
    """The serving child, SIGSTOPped; continued on the way out should it still be there."""
    pid = vetter.pid
    assert pid is not None and vetter.serving
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("deadline", ["after the handshake's", "within the handshake's"])
async def test_a_stopped_vetting_child_is_replaced_and_blames_no_metadata_for_good(deadline: str) -> None:
    async with (donor() as md, peers(peer_config()) as (decode,), TransferService(config()) as svc,
                anyio.create_task_group() as tg):
        ticker = Ticker()
        tg.start_soon(ticker.run)
        await legit_transfer(svc, decode)
        vetter = inside(svc).vetter
        handshake_s = svc.config.connect_timeout_s
        late = deadline == "after the handshake's"
        vetter.load_timeout_s = handshake_s + 3 if late else 1.0
        with stopped(vetter) as pid:
            answer = await join(svc, donor_name(1), renamed(md, 1), wait=handshake_s + 10)
            if late:  # the handshake gave up first: its peer is told so, or just closed on
                assert answer is None or isinstance(answer, Reject), answer
            else:  # the deadline came first: refused, and why
                assert isinstance(answer, Reject) and answer.kind == "vetting_unavailable", answer
                assert "did not load within 1 s" in answer.message, answer.message
            await legit_transfer(svc, decode)  # a linked peer is not held up meanwhile
            await eventually(lambda: vetter.pid not in (None, pid) and vetter.serving, timeout=REPLACED_S,
                             what="a replacement for the stopped vetting child")
        await eventually(lambda: gone(pid), timeout=10, what="the stopped child reaped")
        assert vetter.children_started == 2
        # not remembered as unsafe: the metadata it hung on loads now
        answer = await join(svc, donor_name(1), renamed(md, 1), wait=handshake_s + 10)
        assert isinstance(answer, Join), answer
        assert "metadata_unsafe" not in svc.status()["refused"], svc.status()["refused"]
        await legit_transfer(svc, decode)
        tg.cancel_scope.cancel()
    assert ticker.ticks > 100 and ticker.max_lag < 2.0, (ticker.ticks, ticker.max_lag)  # never held up
