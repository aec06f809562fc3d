"""TrialLoader: the vetting child's NIXL agent, and the UCX settings every agent starts with.

The second module of ``_nixl`` that imports ``nixl`` (``agent`` is the first): the vetting
child (``_trust.vetchild``) loads peers' metadata with a ``TrialLoader``, so that bytes which
would abort a process abort that child, not the service.  That child runs one agent per
service (per engine rank), so this module is kept light: the standard library and
``.._results`` at import, NIXL only when a loader is made.

NIXL ships as a small ``nixl`` package over builds per CUDA version (``nixl_cu12``,
``nixl_cu13``, ``nixl_rocm``); ``import nixl`` picks one by the CUDA version torch was built
for, and where torch has none (a CPU build) it imports torch to ask: about 1 s of CPU and
200 MB in a process that needs no torch.  So the child is told the build its service loaded
(``nixl_build``) and imports that one by name: the same UCX as the service's, and no torch.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from .._results import NixlUnavailable

#: NIXL's own C++ log level unless the environment sets ``NIXL_LOG_LEVEL`` (``native_log``)
NIXL_LOG_LEVEL = "FATAL"


_log_level_lock = threading.Lock()
_log_level_users = 0  # threads inside ``nixl_log_level`` that set the variable


@contextlib.contextmanager
def nixl_log_level() -> Iterator[None]:
    """Around NIXL's import and an agent's creation: ``NIXL_LOG_LEVEL`` is ``FATAL`` unless
    the environment sets it, and as it was again once no thread is inside (children, and
    other libraries, choose their own).  NIXL's libraries read it as they load (the first
    import, a backend plugin as an agent loads it); a load without it sets NIXL's C++ log to
    its default level for the whole process."""
    global _log_level_users
    with _log_level_lock:
        if _log_level_users == 0 and "NIXL_LOG_LEVEL" in os.environ:
            ours = False  # the environment's (the operator's) choice
        else:
            ours = True
            _log_level_users += 1
            os.environ["NIXL_LOG_LEVEL"] = NIXL_LOG_LEVEL
    try:
        yield
    finally:
        if ours:
            with _log_level_lock:
                _log_level_users -= 1
                if _log_level_users == 0:
                    os.environ.pop("NIXL_LOG_LEVEL", None)


def nixl_build() -> str:
    """The package of the NIXL build this process loads (``nixl_cu13``, say; ``nixl`` where NIXL
    is one wheel): its vetting child loads the same.  ``nixl`` when NIXL cannot be imported
    here: the child's own import then says why."""
    try:
        with nixl_log_level():  # this may be the process's first import of NIXL
            api = importlib.import_module("nixl._api")
    except ImportError:
        return "nixl"
    return api.__name__.rpartition(".")[0] or "nixl"


@contextlib.contextmanager
def ucx_environment(overrides: Mapping[str, str]) -> Iterator[None]:
    """Apply ``overrides`` (variables already set win) and restore on exit, so one
    service's UCX settings never leak into another created later in the process."""
    saved = {key: os.environ.get(key) for key in overrides}
    for key, value in overrides.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


#: a trial loader's warm-up drives its partner and itself this many times, this far apart
#: (5 rounds settled the connection on a loaded 2-core machine)
WARM_UP_ROUNDS = 10
WARM_UP_PAUSE_S = 0.002


class TrialLoader:
    """A bare NIXL agent (UCX backend, no memory) that loads a peer's metadata and
    unloads it at once: the vetting child's half of ``add_peer``.  ``build`` is the
    package of the NIXL build to use (``nixl_build`` in the service)."""

    def __init__(self, agent_name: str, *, ucx_env: Mapping[str, str], build: str = "nixl") -> None:
        try:
            with nixl_log_level():
                api: Any = importlib.import_module(f"{build}._api")
                bindings = importlib.import_module(f"{build}._bindings")
        except ImportError as exc:
            raise NixlUnavailable(f"cannot import nixl ({build}): {exc}") from exc
        # NIXL raises its own classes: any of them is NIXL refusing the metadata
        self._errors: tuple[type[Exception], ...] = tuple(
            cls for cls in vars(bindings).values() if isinstance(cls, type) and issubclass(cls, Exception))
        logging.getLogger("nixl").setLevel(logging.WARNING)
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        cannot: tuple[type[Exception], ...] = (RuntimeError, *self._errors)
        try:
            with nixl_log_level(), ucx_environment(ucx_env):  # read as the backend loads
                self._agent: Any = api.nixl_agent(agent_name, config)
        except cannot as exc:
            raise NixlUnavailable(f"cannot create NIXL agent: {exc}") from exc
        self._name = agent_name
        self._ucx_env = ucx_env
        self._build = build

    def warm_up(self) -> str | None:
        """Load and unload a partner agent of this process once: the first load in a
        process pays UCX's one-time set-up (~9 ms here, later ones ~0.3 ms), so that
        no peer's vetting does.  ``None``, or NIXL's error.

        The load opens a UCX connection to the partner that only completes while the
        partner's side is driven too: gone at once, it left UCX retrying to connect to a
        closed port (``Connection refused``, logged by UCX).  So both are driven a few
        times (at most ``WARM_UP_ROUNDS``) before the partner goes."""
        partner = TrialLoader(f"{self._name}-warm", ucx_env=self._ucx_env, build=self._build)
        try:
            return self.try_load(bytes(partner._agent.get_agent_metadata()))
        finally:
            for _ in range(WARM_UP_ROUNDS):
                self.progress()
                partner.progress()
                time.sleep(WARM_UP_PAUSE_S)
            del partner

    def try_load(self, metadata: bytes) -> str | None:
        """``None`` when NIXL loaded ``metadata`` (it is unloaded again), else NIXL's
        error.  An abort here ends the calling process: run it in a child only."""
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except self._errors as exc:
            return f"{type(exc).__name__}: {exc}"
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        try:
            self._agent.remove_remote_agent(name)
        except self._errors as exc:
            return f"loaded, but not removed again: {type(exc).__name__}: {exc}"
        self.progress()  # let UCX finish closing what the load opened towards the peer
        return None

    def progress(self) -> None:
        """Drive UCX's progress once (this agent has no progress thread): endpoints it
        is closing finish closing, and what peers send it is read rather than left
        queued in the kernel."""
        self._agent.get_new_notifs()
