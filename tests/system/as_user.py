"""Run a Python module as another user: ``python -m tests.system.as_user UID HOME PYTHON -m MODULE ARG...``.

Started as root, it imports what the module will need while the interpreter's own
files are readable (they need not be for that user), drops to ``UID`` (group
``UID``, no other groups) with ``HOME=HOME`` and no ``XDG_*`` directories of root's,
then runs ``MODULE`` as ``__main__`` in this same process (so its pid is the
module's, as ``PeerProcess.start(prefix=...)`` wants of a launcher).
"""

from __future__ import annotations

import os
import runpy
import sys


def warm_up() -> None:
    """What ``kvservice.testing.peer`` loads, some of it lazily: the service, NIXL, the event
    loop (not the module itself, which runs as ``__main__``)."""
    import anyio
    import torch  # noqa: F401

    import kvservice._nixl.agent
    import kvservice._runtime
    import kvservice._service
    import kvservice.memory.synthetic
    import kvservice.sidecar
    import kvservice.testing  # noqa: F401

    anyio.run(anyio.sleep, 0)


def main(argv: list[str]) -> None:
    uid, home, _python, dash_m, module, *args = argv
    assert dash_m == "-m", argv
    warm_up()
    for name in [k for k in os.environ if k.startswith("XDG_")]:
        del os.environ[name]
    os.environ["HOME"] = home
    os.setgroups([])
    os.setgid(int(uid))
    os.setuid(int(uid))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
