"""The one door to NIXL: the only package of kvservice that imports ``nixl``.

Everything above it speaks kvservice's types; nothing above it ever holds a NIXL
handle, and no NIXL exception crosses it except as the ``original`` of a
``DoorError`` (which carries a ``FailureReason``).

- ``door``: the interface every layer above NIXL speaks (``Door``, a protocol), its
  errors (``DoorError``), the tick the watchdog runs in one door call (``run_tick``), and
  ``DoorThread``, the one thread every door call runs on.  No ``nixl`` import.
- ``agent``: ``NixlDoor``, the door over a real ``nixl_agent``; NIXL's exceptions mapped
  to failure reasons (``classify``).  It imports ``nixl``, tolerating its absence:
  ``import kvservice`` never needs it.
- ``trial``: ``TrialLoader``, what the vetting child (``_trust.vetchild``) loads peers'
  metadata with, so that child too reaches NIXL only here; and the UCX settings every
  agent starts with.  It imports the NIXL build its service uses (``nixl_build``) only
  when a loader is made, and nothing else of kvservice but ``_results``: the child runs it
  without the rest of the package (and without torch).  This ``__init__`` imports nothing,
  so that the child's import of ``trial`` stays light.
- ``native_log``: UCX's own log lines read from a pipe and logged as kvservice's
  ``ucx.*`` events (the door's agents; the vetting child's stay on its stderr), and
  NIXL's own level while it loads.  No ``nixl`` import.

Who may call it: the request plane (``_transfer``: the watchdog posts and checks), the
control plane (``_control``: loading and unloading peers), the service's lifetime
(``_service``: creating and closing the agent), the vetting (``_trust.vetting``: which NIXL
build its child loads) and the vetting child.  Unit tests put a
scripted fake behind the same interface (``kvservice.testing``); integration and fault
tests drive the real one.
"""
