"""The control plane: how services find, prove and talk to each other.

One concern, one folder.  Everything a peer says before and after authentication
travels here; what the requests *mean* lives in the request plane (``_transfer``).

- ``protocol``: the messages (msgspec structs whose fields carry their bounds), their
  framing, and the NIXL notification format with its MAC.
- ``transport``, ``accept``: TCP listening and dialling, and the accept loop that
  backs off from ``accept()`` errors instead of ending the service.
- ``preauth``: handshake slots shared fairly between sources before the key is proved.
- ``links``: a peer's framed, sealed stream after the handshake (``PeerLink``: outbox,
  heartbeat, liveness).
- ``handshakes``: both sides of the handshake up to the Joins (Hellos, proofs, the
  link's secrets, the sealed Joins), and probes.
- ``addresses``, ``addressbook``: canonical "host:port" spellings, and which agent is
  proven (never merely claimed) to answer at which address.
- ``named``: which member the engine named at which address, taken only from an agent
  that proves that member.
- ``plane``: ``ControlPlane``, the peer table: admission of a met peer and loading into
  NIXL (``_trust`` holds the keys, proofs and checks), dialling, drops.
- ``departures``: a lost agent unloaded from NIXL once its drain ended, and forgotten
  once it is known gone for good.
- ``refusals``: what a handshake is refused for (room in all and per source, metadata
  vetting) and how a refusal is told, counted and logged.
- **source**: the IP address a connection comes from (``preauth.source_of``).  Agent
  names cost a key holder nothing; sources do, so shared bounds are charged to them; a
  linked peer that proved a member is charged to its member instead (``preauth.charged_to``).
  Before the handshake a source is what an address costs to have
  (``preauth.budget_key``: an IPv6 /64, the loopback addresses but 127.0.0.1 as one).
"""
