"""The watchdog's cadence: how often it polls NIXL, idle (a back-off, not a clock) and busy.

While transfers are in flight or expected the watchdog polls NIXL every ``poll_interval_s``
(its lingering ticks).  Idle, nothing needs NIXL driven: a peer writes into this process only
once it holds an Expect of this service, and only after it said so: a sender of protocol 7
sends ``Posted`` once it has posted a request's first WRITE, and that frame wakes the watchdog
at once (``RequestPlane.warm``); for a sender of an older version ``expect()`` does.  An Expect
whose ``Posted`` has not come is *cold*: polled for ``EXPECT_GRACE_S`` after it goes out (a
sender whose ``send()`` came first posts as it reads it), then held at this idle cadence.
``send()`` and every other piece of new work wake it too.  What may still come unannounced is a
notification just after work ends (a settle fence, a late WRITE of a request that failed),
a notification of a cold Expect's request (it turns it warm), and the deadlines of what is
held without being in flight (an Expect before its ``send()``, a ``send()`` before its Expect,
which polls nothing: nothing is posted before the Expect comes): an idle wait ends by the
earliest of them (``Watchdog._idle_wait``).  After a polled request ends,
cold Expects are polled on for ``WARM_GRACE_S`` (the next hand-off usually comes within it);
after a request failed with its pages held, for ``SETTLE_POLL_S`` (what settles them needs it).

So each idle wait is twice the one before it, from ``IDLE_FIRST_S`` after the last work up to
``idle_poll_interval_s``: a notification soon after the last request is taken as promptly as
by a steady 50 ms poll, and a service idle for long wakes once per ``idle_poll_interval_s``.
Any work, or a notification taken while idle, starts the back-off again.  A side that holds
nothing a notification could be for (no request, no pages unsettled: ``RequestPlane.quiet``)
waits ``idle_poll_interval_s`` at once: with hand-offs one at a time (an engine's one request
in flight) that is a tick, and three thread wake-ups, less per request on each side.
"""

from __future__ import annotations

from collections.abc import Iterable

#: the first idle wait after work (the back-off doubles it up to the configured ceiling)
IDLE_FIRST_S = 0.05
#: how long a receiver keeps polling after its last polled request ended while it holds cold
#: Expects: a sender's next request usually follows within it (hand-offs one after another),
#: and polling on costs less than a wake-up from the idle wait for each of them
WARM_GRACE_S = IDLE_FIRST_S
#: how long a receiver polls after it sent a cold Expect.  A sender whose ``send()`` came
#: first (a prefill-first router's flow: the prefill finished before the decode reserved its
#: pages) posts as the Expect reaches it, and with NIXL's progress thread off that WRITE
#: completes within its post only if the receiver called into NIXL meanwhile: polled, the
#: post returns ``DONE`` and the notification is taken as it comes; left cold, the post
#: returned ``PROC``, and the sender's ``Posted``, a check and the receiver's wake-up followed
#: (``benchmarks.handoff``; docs/perf/library.md, "One hand-off against a pull").  A sender
#: not ready yet costs the receiver this long of polling per Expect, then its idle cadence.
EXPECT_GRACE_S = 0.01
#: while a receiver holds one to ``LIGHT_RECVS`` receiving requests (one hand-off at a time:
#: ``RequestPlane.light``), none larger than ``LIGHT_MAX_BYTES``, and no WRITE of its own is in
#: flight, its lingering ticks poll every ``LIGHT_POLL_S`` (or ``poll_interval_s``, if finer),
#: not every ``poll_interval_s``.  On this transport a WRITE into it ends at its next poll:
#: polled that often while the copy runs, the sender's post itself ends it and the notification
#: is taken within ``LIGHT_POLL_S`` of it.  The polls last only while that request is polled for
#: (``busy``: from its Expect's ``EXPECT_GRACE_S``, or its sender's ``Posted``, to its arrival).
#: With more requests held the configured cadence stays: a receiver expecting many polls for
#: many, and where their WRITEs come back to back the finer cadence's CPU slowed the copies
#: sharing the cores; so it did for one 256 MiB request, whose copy a poll's 0.2 ms sooner
#: does not shorten by anything measurable (docs/perf/library.md, "A receiver polling for one
#: hand-off")
LIGHT_RECVS = 1
LIGHT_MAX_BYTES = 64 * 2**20
LIGHT_POLL_S = 0.0001
#: how long a receiver keeps polling after one of its requests failed with pages held for a
#: linked sender: the WRITEs that sender let go when the request failed on its side (checked
#: on until they end, ``_transfer.drain``) and the settle fence behind them complete only
#: while this side calls into NIXL; past it, the idle cadence (a sender held up that long
#: proves them on a later Ask, or at its exit)
SETTLE_POLL_S = 10.0

#: after a post that returned in flight, lingering ticks poll every ``FINE_POLL_S`` for this
#: long, then every ``poll_interval``: the WRITE most likely ends within it (its receiver's
#: next poll), and a sender that sees it at once sends its next request at once
FINE_WINDOW_S = 0.002
FINE_POLL_S = 0.00005
#: how long a tick that posted a lone request (``watchdog.Owner.lone``: one hand-off at a time) to a
#: receiver known to be polling (``Warmth``), with nothing else in flight, follows the WRITEs its
#: posts left in flight, on the door thread, every ``FINE_POLL_S`` (``TickPlan.follow``): such a
#: WRITE ends at its receiver's next poll (``poll_interval_s`` apart, 0.5 ms by default), and
#: seen ending there the request costs the loop one tick, not two.  Not with other WRITEs in
#: flight (their ends would wait for the follow's) nor other sends under way: there one tick
#: already posts a request and checks another's, and the sidecar's daemon at W3/c4 measured
#: 4 % slower with the follow (docs/perf/library.md)
FOLLOW_S = 0.001


class IdleBackoff:
    """The idle waits of one watchdog: ``next()`` doubles from ``IDLE_FIRST_S`` (or
    ``ceiling``, if lower) up to ``ceiling``; ``reset()`` starts again."""

    def __init__(self, ceiling: float) -> None:
        if ceiling <= 0:
            raise ValueError(f"ceiling must be positive, got {ceiling!r}")
        self.ceiling = ceiling
        self._first = min(IDLE_FIRST_S, ceiling)
        self._wait = self._first

    def next(self) -> float:
        """The wait to use now; the one after it is twice as long (at most ``ceiling``)."""
        wait = self._wait
        self._wait = min(self.ceiling, wait * 2)
        return wait

    def reset(self) -> None:
        self._wait = self._first


class Warmth:
    """Which receivers a sender knows to poll now.  A receiver polls on for ``WARM_GRACE_S``
    after taking a request's notification (``RequestPlane.busy``); this sender saw it take
    one no earlier than the tick began whose post (or follow of it) completed that request.
    So a peer counts as polling for ``WARM_GRACE_S / 2`` after that tick began, half the
    grace left as margin for the receiver's loop.  Its posts may then be followed
    (``FOLLOW_S``), and need no ``Posted`` word."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        #: per peer, when the last tick began whose post completed a request to it
        self._seen: dict[str, float] = {}

    def saw(self, peer: str, tick_began: float) -> None:
        """A request to ``peer`` completed within the tick that began at ``tick_began``."""
        self._seen[peer] = tick_began

    def polls(self, peer: str, now: float) -> bool:
        seen = self._seen.get(peer)
        return seen is not None and now - seen < WARM_GRACE_S / 2

    def all_poll(self, peers: Iterable[str], now: float) -> bool:
        return all(self.polls(peer, now) for peer in peers)

    def forget(self, peer: str) -> None:
        """``peer`` is unloaded: nothing is known of it any more."""
        self._seen.pop(peer, None)
