"""A member certificate rotated while the service runs (docs/security.md "Rotation").

``IdentityWatch`` holds the identity in force for new handshakes.  The control plane's
one watch of the trust files (``_control.plane``, with the revocation list's) looks at
``identity_cert_file`` and ``identity_key_file`` every ``revocation.POLL_S`` seconds (a
``stat`` each); when either changed, the pair is read again (in a worker thread) and put
in force once it checks out as ``load_identity`` checks it at start (the key is the
certificate's, issued by the CA in force, valid now, the role configured) and names the
same member: the same cluster, name and role.  Links already made stay as they are: they
were proven under the certificate before, which is still valid.

A pair that does not check out (half-written, another member's, a key that is not the
certificate's, expired) is logged, counted once per change (``ROTATION_REFUSED``) and
left: the identity before stays in force.  A writer replaces each file by a rename, so a
file is never read half-written, but between the two renames the pair is mixed: when only
one of the two files changed and the pair does not check out, it is looked at once more at
the next poll before it is refused.  Each poll also says again whether the certificate in
force is near its end (``revocation.expiry_warning``): the warning appears while running
and clears once a longer one is in force.
"""

from __future__ import annotations

from .._log import get_logger
from .._results import ConfigError
from .identity import Identity, load_identity
from .revocation import Stamp, expiry_warning, stamp_of

log = get_logger("kvservice")

#: refusal kind: a changed identity pair that did not check out (the one before kept)
ROTATION_REFUSED = "identity_rotation"

_Stamps = tuple[Stamp | None, Stamp | None]


class IdentityWatch:
    """This service's identity as it holds it: the pair in force, and its files watched."""

    def __init__(self, identity: Identity, cert_file: str, key_file: str, ca_file: str, role: str = "") -> None:
        self.current = identity
        self._files = cert_file, key_file, ca_file
        self._role = role
        self._judged: _Stamps = self._stamps()  # the files as last judged (in force, or refused)
        self._pending: _Stamps | None = None  # one file changed, the pair mixed: judged at the next poll
        #: what ``expiry_warning`` said at the last poll (``None``: nothing)
        self.warning: str | None = None
        self._warned: int | None = None  # the serial whose warning was logged
        self.polls = 0
        self.expiry()

    def _stamps(self) -> _Stamps:
        return stamp_of(self._files[0]), stamp_of(self._files[1])

    def read(self) -> Identity | ValueError | None:
        """The pair in the files when it changed since last judged and checks out; a
        ``ValueError`` saying why it does not; ``None``: unchanged (or the same
        certificate), or mixed and looked at again next time.  File I/O: a worker thread's."""
        self.polls += 1
        stamps = self._stamps()
        if stamps == self._judged:
            return None
        why: str | None
        try:
            new = load_identity(*self._files, role=self._role)
        except ConfigError as exc:
            why = str(exc)
        else:
            why = self._same_member(new)
            if why is None:
                self._judged, self._pending = stamps, None
                return None if new.der == self.current.der else new
        one_changed = (stamps[0] == self._judged[0]) != (stamps[1] == self._judged[1])
        if one_changed and stamps != self._pending:
            self._pending = stamps  # likely between a writer's two renames
            return None
        self._judged, self._pending = stamps, None  # refused once, not again each poll
        return ValueError(why)

    def _same_member(self, new: Identity) -> str | None:
        old = self.current
        if new.ca != old.ca:
            return (f"identity_ca_file: {self._files[2]!r} holds another authority than the one in force "
                    "(a new authority is put in force by a restart)")
        if new.member.uri != old.member.uri:
            return (f"identity_cert_file: {self._files[0]!r} now names member {new.member.uri}, this service "
                    f"is {old.member.uri} (a rotation keeps the member; another member is another service)")
        return None

    def apply(self, loaded: Identity | ValueError | None) -> bool:
        """Put what ``read`` returned in force; whether a new pair now is.  A pair that
        did not check out is logged and left (the caller counts it)."""
        if loaded is None:
            return False
        old = self.current.member
        if isinstance(loaded, ValueError):
            log.error("identity.rotation_refused", file=self._files[0], why=str(loaded),
                      kept_serial=f"{old.serial:x}", kept_until=old.not_after.isoformat())
            return False
        self.current = loaded
        new = loaded.member
        log.warning("identity.rotated", member=new.uri, serial=f"{new.serial:x}", until=new.not_after.isoformat(),
                    old_serial=f"{old.serial:x}", old_until=old.not_after.isoformat())
        return True

    def expiry(self) -> str | None:
        """The expiry warning of the certificate in force, now; logged when it appears (or
        a certificate in force later also ends soon), and when it clears."""
        member = self.current.member
        warning = expiry_warning(member)
        if warning is not None and self._warned != member.serial:
            log.warning("identity.expiring", member=member.uri, why=warning)
        elif warning is None and self.warning is not None:
            log.info("identity.expiry_cleared", member=member.uri, until=member.not_after.isoformat())
        self.warning = warning
        self._warned = member.serial if warning is not None else None
        return warning
