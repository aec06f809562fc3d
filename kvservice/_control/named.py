"""Which member the engine named at which address: a name is bound to the member that proves it.

The engine names a peer by a member's name (``expect(sender=name)``, ``send(receiver=name)``
with discovery) or by an address a registry vouched a member for (an SGLang rank's
registered member, ``expect(member=)``).  Either way the address is where that member said
it listens, and the name is bound to the member that *proves* itself there: once an
address is named for member ``m``, a link to it is used (``ControlPlane.link_to``) and an
agent is taken as answering there (``ControlPlane.at_address``) only when its handshake
proved ``m``'s certificate.  An agent of another member at that address (a member answering
on another's address, or a registry's answer pointing a decode elsewhere) is refused
(``MEMBER``, counted) and the request fails ``REFUSED``, saying which member was named and
which proved itself.

Without an identity here, names are not bound (nothing proves them); a peer that proves
no identity (``allow_peers_without_identity``) cannot prove a name either.  The last name
given for an address stands; at most ``KEPT`` addresses are remembered (oldest forgotten).
"""

from __future__ import annotations

from collections import OrderedDict

from .._trust.identity import MEMBER, IdentityRefused, Member

#: addresses remembered with the member named there
KEPT = 4096


class Names:
    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled  # this service has an identity: names can be proven
        self._named: OrderedDict[str, str] = OrderedDict()  # canonical address -> member name

    def name(self, canon: str, member: str) -> None:
        """The engine expects ``member`` at ``canon`` from now on."""
        if not self._enabled:
            return
        self._named[canon] = member
        self._named.move_to_end(canon)
        while len(self._named) > KEPT:
            self._named.popitem(last=False)

    def refusal(self, canon: str, agent: str, proven: Member | None) -> IdentityRefused | None:
        """Why ``agent`` (which proved ``proven``) may not stand for the member named at
        ``canon``; ``None`` when it may (or nothing was named there)."""
        named = self._named.get(canon)
        if named is None or (proven is not None and proven.name == named):
            return None
        who = f"member {proven.uri}" if proven is not None else "no member identity"
        return IdentityRefused(f"{canon} was named as member {named!r}'s address, but agent {agent!r} there proves "
                               f"{who}: a name is taken only from the member that proves it", MEMBER)
