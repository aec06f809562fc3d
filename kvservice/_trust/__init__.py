"""Who may talk to this service, and what they may say.

* ``keys``: the cluster's shared key on disk (load it as ssh loads a private
  key: refused when others can read it; ``kvservice keygen`` writes one).
* ``handshake``: the mutual challenge-response both peers run before any NIXL
  metadata moves, and the per-frame MACs that protect the link afterwards.
* ``mac``: HMAC-SHA256 for the MACs computed per request (frames, notifications,
  hand-offs), with each key's block hashes kept: the same tags at a quarter of the cost.
* ``handoff``: the MAC an engine's hand-off carries (vLLM's ``kv_transfer_params``), under
  a key derived from the cluster's key for that use alone, and with member identities its
  prefill member's signature, checked as the handshake's certificates are.
* ``identity``, ``authority``: member identities (a member's own key and X.509
  certificate from the cluster's authority) and a small authority that issues them.
* ``revocation``, ``rotation``: the revocation list and the service's own pair, re-read
  when their files change (one watch: ``_control.plane``), and the expiry warning.
* ``checks``: range checks of every field a peer supplies, before it reaches
  arithmetic, an allocation or NIXL.
* ``peercred``: the uid of the process at the other end of a Unix socket.
* ``metadata``: a peer's NIXL metadata read as NIXL reads it, refused when
  malformed, before NIXL sees it.
* ``vetting`` and ``vetchild``: what passes is loaded first in a child process
  with its own NIXL agent; metadata that kills the child is never loaded here.
* ``strikes``: a source whose metadata cost a vetting child is vetted on a child
  of its own, and refused for a doubling backoff when it does so again.
"""
