"""A request id is its first user's, on both sides, for as long as the daemon keeps
anything of it (``kvservice/sidecar/owners.py``), with real daemons, real NIXL and real
shared memory.

The decode daemon here serves both roles (so a worker can try the side of an id it does
not use) and keeps 8 results per side (so "as long as it keeps them" is reached quickly).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

import pytest
import torch

from kvservice import FailureReason, KVPoll, SidecarClient, UnknownRequestError
from kvservice.sidecar import NotOwnerError
from kvservice.testing import pattern

from .daemons import Sidecar, metrics, sidecars

pytestmark = pytest.mark.nixl

KEPT = 8
NOT_OWNER = 'kvservice_refused_total{where="workers",kind="not_owner"}'
REFUSAL = r"^request '{}' belongs to another worker of this sidecar$"


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Sidecar, Sidecar]]:
    env = {"KVSERVICE_SIDECAR_ROLES": "prefill, decode", "KVSERVICE_SERVICE_RESULTS_KEPT": str(KEPT)}
    with sidecars("prefill", "decode", env=env) as (p, d):
        yield p, d


async def refused_all(rid: str, calls: list[Callable[[], Awaitable[object]]]) -> int:
    for call in calls:
        with pytest.raises(NotOwnerError, match=REFUSAL.format(rid)):
            await call()
    return len(calls)


def everything(b: SidecarClient, rid: str, sender: str) -> list[Callable[[], Awaitable[object]]]:
    """Every call another worker could make naming ``rid``, on either side."""
    return [
        lambda: b.await_arrival(rid, timeout=1), lambda: b.fetch_poll_arrival(rid),
        lambda: b.send(rid, [9]), lambda: b.send(rid, [9], last=True, payload=b"forged"),
        lambda: b.abort(rid), lambda: b.await_settled(rid, timeout=1),
        lambda: b.expect(rid, [30], sender=sender), lambda: b.decline(rid, sender=sender),
        lambda: b.expected(rid), lambda: b.expected_pages(rid), lambda: b.expect_dropped(rid),
    ]


async def test_a_worker_refused_on_one_side_cannot_take_the_other(pair: tuple[Sidecar, Sidecar]) -> None:
    """The finding: A expects an id; B is refused on it, then tries to start the unused
    sending side (``send``) to abort A's expect and read A's result through
    ``await_settled``.  Every call of B's is refused and counted; A's expect goes on
    untouched and completes byte-exact with its payload; B cannot read the result."""
    prefill, decode = pair
    before = await metrics(decode.http)
    async with SidecarClient(prefill.socket, name="sender") as w, SidecarClient(decode.socket, name="a") as a, \
            SidecarClient(decode.socket, name="b") as b:
        rid, src, dst = "a-only", [10, 11], [20, 21]
        w.kv.write(src, pattern(w.layout, rid, 2))
        await a.expect(rid, dst, sender=w.address)
        n = await refused_all(rid, [lambda: b.await_arrival(rid, timeout=1)])
        n += await refused_all(rid, [lambda: b.send(rid, [9])])  # the unused side: still A's
        n += await refused_all(rid, [lambda: b.abort(rid), lambda: b.await_settled(rid, timeout=1)])
        assert await a.fetch_poll_arrival(rid) is KVPoll.WaitingForInput  # A's expect is live, untouched
        sent = await w.await_completion(await w.send(rid, src, last=True, payload=b"first-token"), timeout=30)
        assert sent.ok, sent
        arrived = await a.await_arrival(rid, timeout=30)
        assert arrived.ok and arrived.payload == b"first-token", arrived
        assert torch.equal(a.kv.pages(dst), pattern(a.layout, rid, 2))
        n += await refused_all(rid, everything(b, rid, w.address))  # ended: still A's
        settled = await a.await_settled(rid, timeout=10)  # the owner reads it
        assert settled.ok and settled.settled and settled.payload == b"first-token", settled
        assert torch.equal(a.kv.pages(dst), pattern(a.layout, rid, 2))
    after = await metrics(decode.http)
    assert after.get(NOT_OWNER, 0) - before.get(NOT_OWNER, 0) == n
    assert not [ev for ev in decode.events("transfer.failed") if ev.get("request_id") == rid]


async def test_an_ended_id_stays_its_owners_while_its_result_is_kept(pair: tuple[Sidecar, Sidecar]) -> None:
    """A's request ends; three times ``results_kept`` requests of another worker end on
    the *sending* side, which does not push A's receiving result out: A still reads it, and
    B still cannot, on either side.  Once ``results_kept`` receiving requests have ended
    after it, the daemon has forgotten it, and so has ownership: the id is nobody's."""
    prefill, decode = pair
    async with SidecarClient(prefill.socket, name="sender") as w, SidecarClient(decode.socket, name="a") as a, \
            SidecarClient(decode.socket, name="b") as b, SidecarClient(decode.socket, name="c") as c:
        rid, src, dst = "kept-long", [12, 13], [22, 23]
        w.kv.write(src, pattern(w.layout, rid, 2))
        await a.expect(rid, dst, sender=w.address)
        assert (await w.await_completion(await w.send(rid, src, last=True, payload=b"p"), timeout=30)).ok
        assert (await a.await_arrival(rid, timeout=30)).ok

        for i in range(3 * KEPT):  # other requests end: sends, aborted before anyone expects them
            other = f"filler-send-{i}"
            await c.send(other, [50], last=True)
            assert (await c.abort(other) or await c.await_settled(other)).reason is FailureReason.ABORTED
        kept = await a.await_settled(rid, timeout=10)  # asks the daemon: the result is still there
        assert kept.ok and kept.payload == b"p", kept
        await refused_all(rid, everything(b, rid, w.address))

        for i in range(KEPT + 2):  # receiving requests end (nobody listens there): A's result falls out
            other = f"filler-recv-{i}"
            await c.expect(other, [51], sender="127.0.0.1:1")
            assert not (await c.await_arrival(other, timeout=10)).ok
        with pytest.raises(UnknownRequestError):  # forgotten by the service, and so nobody's
            await b.await_settled(rid, timeout=1)
        with pytest.raises(UnknownRequestError):
            await a.await_settled(rid, timeout=1)
