"""The request plane: every request of a running service, on both sides, from the call
that makes it to the moment nothing of it can be written any more.

One concern, one folder.  ``TransferService`` (``kvservice._service``) checks the
caller's arguments, resolves names and owns the lifetime; once started it builds one
``RequestPlane`` and hands it every request operation.  The plane builds its
collaborators (the watchdog here, the control plane in ``_control``) so that none of
them is ever missing while it exists.  Nothing here imports ``nixl``: NIXL is reached
through the door (``_nixl.door``) on its one thread.  Everything runs on the event loop
except what the door thread runs for it.

Reading path:

- ``requests``: a request's state on each side (``SendRequest``, ``RecvRequest``), the
  public ``TransferHandle``, results made from requests, and ``Recent``, a bounded table.
- ``early``: ``EarlyExpects``, Expects held for a ``send()`` not made yet, bounded per
  peer, per source and in total.
- ``plane``: ``RequestPlane``: the tables, the entry points (send, expect, abort, drain),
  the transitions (bind, finish, fail) and the watchdog's callbacks.
- ``matching``: ``Matching``: how a send meets the Expects that came before it (which
  peer may bind it, which are refused, which wait for a proof) and the dropped ones.
- ``waits``: how callers wait on the plane (for an end, an arrival, a settling).
- ``ends``: ``SendEnds``: how a failed send ends (its release, the receiver's Outcome,
  its settle fence).
- ``inbound``: ``Inbound``: what peers say (Expect, Abort, Failed, Outcome, Settled, the
  chunks' notifications, a link lost or made) turned into the plane's transitions.
- ``watchdog``: the one task that posts chunks, checks handles, releases them and
  polls notifications, one bounded door call per tick; ``cadence``: how often it polls
  (idle: a back-off from the last work rather than a clock; busy: the fine window after a
  post, the follow of a lone request's, which receivers it knows to poll); ``posts``: a
  chunk's or a settle fence's ``PostOp``; ``delivery``: a lingering tick's notifications
  handed to the loop as they come; ``drain``: ``Drains``, a lost receiver's handles, and a
  failed request's let go in flight, it checks until each ends.
- ``settle``: ``Settlement``: which failed receiver requests are unsettled, and why
  each piece of evidence may settle them.
- ``proofs``: ``Proofs``: which requests a sender could not prove over to their receiver
  (a WRITE let go before ``DONE``); ``heal``: ``Heal``: the receiver's ``Ask`` on a new
  link, the sender's answer.
- ``deadlines``: the heap of request deadlines the watchdog pops each tick.
- ``history``: ``Results``, the results of the most recent ended requests, kept as tuples.
- ``staging``: which requests move through the staging buffer, the ranges they hold and
  the copies in and out of it (what a staged page *is* stays in ``memory._staging``).
- ``landing``: opt-in landing checks: the sender's CRC32C of each chunk's bytes (on the
  door thread, before its WRITE), the receiver's check of its pages (on a worker thread)
  before it reports SUCCESS.

Glossary:

- **bound**: a send is bound once a receiver's Expect gave it its destination pages;
  before that it is *bootstrapping* and its chunks queue.
- **cold**: a receiver's Expect whose sender (protocol 7) has not said ``Posted`` yet:
  held at the idle cadence, not polled, once ``EXPECT_GRACE_S`` after it went out has
  passed (a sender already waiting for it posts within that).
- **early expect**: an Expect that arrived before the ``send()`` of its id; held
  (bounded per peer, per source and in total, with a TTL) for the first send to bind.
- **source**: what a peer's use of shared bounds is charged to: the member its link
  proved, else the IP address its link comes from.  A key holder mints agent names
  for nothing, not member identities or addresses: shared bounds are charged to the
  source as well.
- **pinned**: a send made with ``receiver=``: only the agent proven to answer at that
  address may bind it; any other peer's Expect is refused (``REFUSED``) and counted.  One
  still unbound fails ``PEER_LOST`` when the agent proven there is lost and none other is
  proven there (``Inbound._orphaned``).
- **proven**: an agent is proven at an address when this service dialled that address
  and the agent answering there proved its identity in the handshake; a claim (an
  address a peer advertises) is never acted on.
- **outcome**: a receiver's answer to a sender's ``Failed``: whether it had every page
  already.  A send whose chunks were posted waits for it (bounded), so both sides agree
  on how the request ended.
- **fence**: one more page WRITE a sender posts, once every WRITE of a failed request
  has ended and one of them not ``DONE``, on the same link; its notification arrives
  only after every earlier WRITE of that endpoint has landed.
- **let go**: a failed request's handles still in flight, checked until they end (at
  most ``DRAIN_S``) rather than released, so that they may end ``DONE`` (``drain``).
- **drain**: a lost receiver's handles in flight, checked until they end (bounded by
  ``proofs.drain_limit``) rather than released at once, so that they may end ``DONE``.
- **proven over**: (a request, to its receiver) every WRITE of it the sender posted reached
  ``DONE`` before it was let go, or it posted none.
- **landing sum**: the CRC32C of the bytes one chunk's WRITE moves, in the pair's descriptor
  order (``landing``); carried by that chunk's notification when the receiver asked.
- **settled**: nothing of the request can be written any more.  A success is settled; a
  receiver's failure is settled by the sender's fence, its ``Settled`` (also in answer
  to an ``Ask`` after a lost link heals), or its process gone; a sender's failure once
  nothing of it is posted and what it let go has ended or its receiver failed it.
  Only a settled request's pages may be reused.
"""
