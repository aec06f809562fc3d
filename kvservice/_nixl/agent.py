"""NixlDoor: the door over a real NIXL agent (where the service imports ``nixl``).

It implements ``door.Door`` over a real ``nixl_agent`` and maps NIXL's
exceptions to ``FailureReason`` (see ``classify``).  Behaviour it relies on,
measured with nixl 1.5.1 (see docs/design.md, "How NIXL behaves"):

* ``transfer()`` / ``check_xfer_state()`` raise for error statuses; they do not
  return ``"ERR"`` in practice (we still treat ``"ERR"`` as a backend failure).
* Using a handle after ``release()`` segfaults the process: the door's handle
  table makes that impossible from kvservice.
* A dead peer stays loaded; recovery is remove + add with fresh metadata +
  prepare its descriptor list again, which ``add_peer`` does.
* ``remove_remote_agent`` does not close the UCX connection to a live peer: each
  remove + add of the same live agent leaves one more TCP connection open on
  both sides (measured).  So a peer whose link was lost while its process may
  live is kept loaded (``remove_peer(keep_loaded=True)``, at most ``KEPT_MAX``),
  and loading it again with the same metadata reuses it (``add_peer``).
* ``add_remote_agent`` hands a peer's bytes to UCX, which unpacks them with
  assertions: malformed bytes can abort the process.  So the service proves a
  peer's metadata loadable in a vetting child first (``_trust.vetting``); the
  child loads it with ``trial.TrialLoader``, which imports the same NIXL build
  by name: ``_nixl`` stays the only package that imports ``nixl``, in the
  service and in that child alike.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import struct
import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._log import get_logger
from .._results import FailureReason, KVServiceError, NixlUnavailable
from .door import PROBE_NOTIF, DoorError, LocalTable, Segment, XferId, XferState
from .native_log import after_agent_created, ucx_log_file
from .trial import nixl_log_level, ucx_environment

log = get_logger("kvservice.nixl")

try:
    with nixl_log_level():  # NIXL reads it as it loads (see native_log)
        from nixl import _bindings as _nb
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    NIXL_IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # pragma: no cover - exercised only without nixl installed
    _nb = None
    NIXL_IMPORT_ERROR = exc


#: agents kept loaded after their link was lost, at most (``remove_peer(keep_loaded=True)``)
KEPT_MAX = 256

_MD_PREFIX = b"nixlSerDes|Agent"
_MD_LEN = struct.Struct("<Q")


def metadata_agent(metadata: bytes) -> str | None:
    """The agent name NIXL's serialised metadata carries, read without loading it.

    NIXL 1.x serialises as ``nixlSerDes|`` then tagged fields, the first being
    ``Agent``, an 8-byte little-endian length and the name.  ``None`` when the
    bytes are not in that form."""
    if not metadata.startswith(_MD_PREFIX):
        return None
    start = len(_MD_PREFIX) + _MD_LEN.size
    if len(metadata) < start:
        return None
    (n,) = _MD_LEN.unpack_from(metadata, len(_MD_PREFIX))
    if n > 256 or len(metadata) < start + n:
        return None
    try:
        return metadata[start : start + n].decode()
    except UnicodeDecodeError:
        return None


class _NeverRaised(Exception):  # outside the KVServiceError family: nothing ever raises it
    """Stands in for a NIXL exception class this NIXL build lacks.

    Deliberately narrow: we never fall back to catching ``RuntimeError`` or
    ``Exception``, which would hide programming errors as transport failures.
    It stands for NIXL's classes, which are not kvservice's: it is never raised,
    only named in ``except`` clauses that then match nothing.
    """


def _nixl_error(name: str) -> type[BaseException]:
    cls = getattr(_nb, name, None)
    if isinstance(cls, type) and issubclass(cls, BaseException):
        return cls
    return _NeverRaised


# Classification of every NIXL exception class.  Order matters only for
# documentation; the classes are unrelated (all subclass ``Exception``).
_REASONS: dict[type[BaseException], FailureReason] = {
    _nixl_error("nixlRemoteDisconnectError"): FailureReason.REMOTE_DISCONNECT,
    _nixl_error("nixlCancelledError"): FailureReason.CANCELLED,
    _nixl_error("nixlNotFoundError"): FailureReason.PEER_LOST,  # peer not loaded (any more)
    _nixl_error("nixlBackendError"): FailureReason.BACKEND,
    _nixl_error("nixlMismatchError"): FailureReason.INCOMPATIBLE,
    _nixl_error("nixlInvalidParamError"): FailureReason.BACKEND,
    _nixl_error("nixlNotAllowedError"): FailureReason.BACKEND,
    _nixl_error("nixlRepostActiveError"): FailureReason.BACKEND,
    _nixl_error("nixlNotPostedError"): FailureReason.BACKEND,
    _nixl_error("nixlNotSupportedError"): FailureReason.BACKEND,
    _nixl_error("nixlUnknownError"): FailureReason.BACKEND,
}
_REASONS.pop(_NeverRaised, None)
NIXL_ERRORS: tuple[type[Exception], ...] = tuple(c for c in _REASONS if issubclass(c, Exception))


def classify(exc: BaseException) -> FailureReason:
    for cls, reason in _REASONS.items():
        if isinstance(exc, cls):
            return reason
    raise TypeError(f"not a NIXL error: {type(exc).__name__}")  # a bug in the caller


@contextlib.contextmanager
def door_environment(overrides: Mapping[str, str]) -> Iterator[None]:
    """``ucx_environment`` and ``nixl_log_level``, with UCX's log going to a pipe kvservice
    reads and logs as its own events, unless the operator chose where UCX logs (``native_log``)."""
    log_file = ucx_log_file(overrides)
    saved = os.environ.get("UCX_LOG_FILE")
    if log_file is not None:
        os.environ["UCX_LOG_FILE"] = log_file
    try:
        with nixl_log_level(), ucx_environment(overrides):  # both read as the backend loads
            yield
    finally:
        if saved is None:
            os.environ.pop("UCX_LOG_FILE", None)
        else:
            os.environ["UCX_LOG_FILE"] = saved
    after_agent_created()


class NixlStatusError(KVServiceError):
    """``transfer``/``check_xfer_state`` returned ``"ERR"`` without raising.

    Stands in for the exception NIXL did not raise: wrapped in a ``DoorError`` as NIXL's
    own are, it ends as the ``error`` of the request that fails ``BACKEND``."""


def nixl_version() -> str:
    try:
        from importlib.metadata import version

        return version("nixl")
    except Exception:  # noqa: BLE001 - metadata is informational only
        return "unknown"


class NixlDoor:
    """``Door`` over one real NIXL agent (UCX backend).  Not thread-safe by design:
    every call comes from the ``DoorThread`` (the agent also runs in STRICT sync
    mode, so an accidental second thread is serialised rather than a segfault)."""

    def __init__(self, agent_name: str, *, progress_thread: bool, ucx_env: Mapping[str, str]) -> None:
        if NIXL_IMPORT_ERROR is not None:
            raise NixlUnavailable(f"cannot import nixl: {NIXL_IMPORT_ERROR}") from NIXL_IMPORT_ERROR
        # NIXL logs through stdlib logging at INFO for every agent/backend; keep it quiet.
        logging.getLogger("nixl").setLevel(logging.WARNING)
        config = nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
            backends=["UCX"],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            with door_environment(ucx_env):  # UCX reads its settings when the backend starts
                self._agent: Any = nixl_agent(agent_name, config)
        except (RuntimeError, *NIXL_ERRORS) as exc:  # type: ignore[misc]
            raise NixlUnavailable(f"cannot create NIXL agent: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable("NIXL has no UCX backend plugin")
        self.agent_name = agent_name
        self._owner = threading.get_ident()
        self._reg: Any = None
        self._mem_type = "DRAM"
        self._local: Any = None  # prepped local dlist (every page of every region)
        self._locals: dict[Hashable, Any] = {}  # key -> prepped local dlist for some peers
        self._peers: dict[str, tuple[Any, Any]] = {}  # name -> (prepped remote dlist, local dlist)
        #: loaded agents (linked or kept after their link was lost): name -> (metadata, remote table)
        self._loaded: dict[str, tuple[bytes, npt.NDArray[np.uint64]]] = {}
        self._kept: collections.OrderedDict[str, None] = collections.OrderedDict()  # loaded, not linked
        self._disconnected: set[str] = set()  # loaded agents NIXL reported disconnected
        self._xfers: dict[XferId, tuple[Any, str]] = {}  # id -> (nixl handle, peer)
        self._next_id = 1
        self._closed = False

    def _check_thread(self) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError("NixlDoor used off its thread")

    # -- setup ----------------------------------------------------------------
    def metadata(self) -> bytes:
        self._check_thread()
        return bytes(self._agent.get_agent_metadata())

    def metadata_agent(self, metadata: bytes) -> str | None:
        return metadata_agent(metadata)

    def register(self, segments: Sequence[Segment], mem_type: str, table: npt.NDArray[np.uint64]) -> None:
        self._check_thread()
        self._mem_type = mem_type
        try:
            self._reg = self._agent.register_memory([(a, n, d, "") for a, n, d in segments], mem_type)
            self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, mem_type)
        except NIXL_ERRORS as exc:
            raise DoorError(classify(exc), exc, "register_memory") from exc

    def _local_for(self, local: LocalTable | None) -> Any:
        if local is None:
            return self._local
        key, table = local
        dlist = self._locals.get(key)
        if dlist is None:
            dlist = self._locals[key] = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, self._mem_type)
        return dlist

    def add_peer(self, name: str, metadata: bytes, table: npt.NDArray[np.uint64],
                 local: LocalTable | None = None) -> None:
        self._check_thread()
        inside = metadata_agent(metadata)
        if inside != name:
            # Checked before loading: metadata naming another (perhaps live) agent must
            # neither load a stranger nor replace, or later remove, that agent.
            raise DoorError(
                FailureReason.INCOMPATIBLE,
                ValueError(f"metadata names agent {inside!r}, the peer authenticated as {name!r}"),
                "add_remote_agent",
            )
        if self._reusable(name, metadata, table):
            if name not in self._peers:  # kept after its link was lost: prepare its table again
                self._kept.pop(name)
                try:
                    self._peers[name] = (self._agent.prep_xfer_dlist(name, table, self._mem_type),
                                         self._local_for(local))
                except NIXL_ERRORS as exc:
                    self._unload(name)
                    raise DoorError(classify(exc), exc, "prepare peer") from exc
            return  # linked again before its unload: as it is, handles in flight included
        if name in self._peers or name in self._kept:
            self.remove_peer(name)
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except NIXL_ERRORS as exc:
            raise DoorError(classify(exc), exc, "add_remote_agent") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            self._agent.remove_remote_agent(loaded)
            raise DoorError(
                FailureReason.INCOMPATIBLE,
                ValueError(f"metadata names agent {loaded!r}, hello named {name!r}"),
                "add_remote_agent",
            )
        self._loaded[name] = (metadata, table)
        self._disconnected.discard(name)
        try:
            self._peers[name] = (self._agent.prep_xfer_dlist(name, table, self._mem_type), self._local_for(local))
            # Pay the connection set-up (15-20 ms) now rather than on the first request.
            self._agent.make_connection(name)
        except NIXL_ERRORS as exc:
            self.remove_peer(name)
            raise DoorError(classify(exc), exc, "prepare peer") from exc

    def _reusable(self, name: str, metadata: bytes, table: npt.NDArray[np.uint64]) -> bool:
        """Whether ``name`` is loaded already, from the same metadata and table, and its endpoint
        still answers.  NIXL 1.5's ``remove_remote_agent`` leaves the UCX connection to a live
        peer open (one more TCP connection on each side per reload, measured), so a link lost
        and made again to the same process must not reload it."""
        loaded = self._loaded.get(name)
        if loaded is None or loaded[0] != metadata or not np.array_equal(loaded[1], table) \
                or name in self._disconnected:
            return False
        try:
            self._agent.send_notif(name, PROBE_NOTIF)
        except NIXL_ERRORS as exc:
            log.info("nixl.endpoint_gone", peer=name, error=repr(exc))
            self._disconnected.add(name)
            return False
        return True

    def remove_peer(self, name: str, *, keep_loaded: bool = False) -> list[XferId]:
        self._check_thread()
        released = [xid for xid, (_, peer) in self._xfers.items() if peer == name]
        for xid in released:
            self.release(xid)
        entry = self._peers.pop(name, None)
        if entry is not None:
            entry[0].release()
        if name not in self._loaded:
            return released
        if keep_loaded and name not in self._disconnected:
            self._kept[name] = None
            self._kept.move_to_end(name)
            while len(self._kept) > KEPT_MAX:
                self._unload(self._kept.popitem(last=False)[0])
        else:
            self._kept.pop(name, None)
            self._unload(name)
        return released

    def forget_peer(self, name: str) -> None:
        self._check_thread()
        if name in self._kept:
            del self._kept[name]
            self._unload(name)

    def kept(self, name: str) -> bool:
        self._check_thread()
        return name in self._kept  # (add_peer takes a reused agent out of it)

    def _unload(self, name: str) -> None:
        self._loaded.pop(name, None)
        self._disconnected.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except NIXL_ERRORS as exc:
            log.warning("nixl.remove_remote_agent_failed", peer=name, error=repr(exc))

    @property
    def kept_agents(self) -> int:
        """Agents kept loaded after their link was lost (``remove_peer(keep_loaded=True)``)."""
        return len(self._kept)

    # -- transfers ----------------------------------------------------------------
    def post(
        self, peer: str, local_idx: npt.NDArray[np.int32], remote_idx: npt.NDArray[np.int32],
        notif: bytes,
    ) -> tuple[XferId, XferState]:
        self._check_thread()
        entry = self._peers.get(peer)
        if entry is None:
            err = KeyError(f"peer {peer!r} not loaded")
            raise DoorError(FailureReason.PEER_LOST, err, "make_prepped_xfer")
        remote, local = entry
        try:
            handle = self._agent.make_prepped_xfer("WRITE", local, local_idx, remote, remote_idx, notif)
        except NIXL_ERRORS as exc:
            raise self._error(peer, exc, "make_prepped_xfer") from exc
        xid = self._next_id
        self._next_id += 1
        self._xfers[xid] = (handle, peer)
        try:
            state = self._agent.transfer(handle)
        except NIXL_ERRORS as exc:
            self.release(xid)
            raise self._error(peer, exc, "transfer") from exc
        return xid, self._settle(xid, state, "transfer")

    def check(self, xfer: XferId) -> XferState:
        self._check_thread()
        entry = self._xfers.get(xfer)
        if entry is None:
            return XferState.GONE
        try:
            state = self._agent.check_xfer_state(entry[0])
        except NIXL_ERRORS as exc:
            self.release(xfer)
            raise self._error(entry[1], exc, "check_xfer_state") from exc
        return self._settle(xfer, state, "check_xfer_state")

    def _settle(self, xfer: XferId, state: str, op: str) -> XferState:
        if state == "PROC":
            return XferState.PROC
        self.release(xfer)
        if state == "DONE":
            return XferState.DONE
        err = NixlStatusError(f"{op} returned {state!r}")
        raise DoorError(FailureReason.BACKEND, err, op)

    def release(self, xfer: XferId) -> bool:
        self._check_thread()
        entry = self._xfers.pop(xfer, None)
        if entry is None:
            return False
        try:
            entry[0].release()
        except NIXL_ERRORS as exc:
            # NIXL could not cancel it; its own finaliser keeps it on the agent's
            # leak list and retries at agent destruction.  We never touch it again.
            log.warning("nixl.release_failed", xfer=xfer, error=repr(exc))
        return True

    def live_xfers(self) -> int:
        return len(self._xfers)

    # -- notifications ------------------------------------------------------------
    def notifs(self) -> Mapping[str, list[bytes]]:
        self._check_thread()
        got: Mapping[str, list[bytes]] = self._agent.get_new_notifs()
        return got

    def send_notif(self, peer: str, message: bytes) -> None:
        self._check_thread()
        try:
            self._agent.send_notif(peer, message)
        except NIXL_ERRORS as exc:
            raise self._error(peer, exc, "send_notif") from exc

    def _error(self, peer: str, exc: BaseException, op: str) -> DoorError:
        """``exc`` from ``op`` on ``peer``'s endpoint; one that says it disconnected is not
        reused when the peer is loaded again."""
        err = DoorError(classify(exc), exc, op)
        if err.reason is FailureReason.REMOTE_DISCONNECT and peer in self._loaded:
            self._disconnected.add(peer)
        return err

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._check_thread()
        self._closed = True
        for xid in list(self._xfers):
            self.release(xid)
        for name in list(self._peers):
            self.remove_peer(name)
        for name in list(self._kept):
            self.forget_peer(name)
        for dlist in self._locals.values():
            dlist.release()
        self._locals.clear()
        if self._local is not None:
            self._local.release()
            self._local = None
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except NIXL_ERRORS as exc:
                log.warning("nixl.deregister_failed", error=repr(exc))
            self._reg = None
        del self._agent
