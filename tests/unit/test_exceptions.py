"""One exception family: every exception class kvservice defines derives from
``KVServiceError`` (docs/api.md "Exceptions"), keeps the builtin base its callers catch,
survives pickling, and joining the family changed no failure's classification.

The family check imports every module of the package and looks at every exception
class the process then knows whose ``__module__`` is kvservice's, so a
``class Foo(Exception)`` added anywhere in ``kvservice`` fails it."""

from __future__ import annotations

import functools
import gc
import importlib
import pickle
import pkgutil
import warnings
from types import ModuleType

import pytest

import kvservice
from kvservice import (
    AuthenticationError,
    ConfigError,
    FailureReason,
    KVServiceError,
    NixlUnavailable,
    ProtocolError,
    TransferFailed,
    UnknownRequestError,
)
from kvservice._control.links import OutboxOverflow
from kvservice._control.peers import IncompatiblePeer, dial_failure
from kvservice._control.protocol import FrameError
from kvservice._nixl.door import DoorError
from kvservice._trust.metadata import MetadataError
from kvservice._trust.peercred import PeerCredError
from kvservice.bench._lines import ChildError
from kvservice.bench.control import ControlError
from kvservice.engine._transfers import _call_failure
from kvservice.integrations.sglang.bootstrap import Refusal
from kvservice.integrations.vllm.params import HandoffError
from kvservice.sidecar.local import DaemonError
from kvservice.sidecar.wire import SidecarRemoteError

#: exception classes of kvservice outside the family, each with why
INTERNAL: dict[str, str] = {
    # stands in for a NIXL exception class the installed NIXL lacks: it is only ever
    # named in ``except`` clauses (so they match nothing) and never raised
    "kvservice._nixl.agent._NeverRaised": "a never-raised stand-in for NIXL's classes",
}

#: import names of pyproject's optional extras, and of what only an extra's engine brings
#: (aiohttp: vLLM's, beside which ``integrations.vllm.proxy`` runs): a module needing one
#: that is not installed is skipped, so the ``test`` extra alone runs this file; any other
#: import error fails
OPTIONAL_PACKAGES = frozenset({"sglang", "vllm", "mooncake", "aetcd", "matplotlib", "aiohttp"})


def _module_names() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(kvservice.__path__, "kvservice.", onerror=lambda name: None)]
    # importing a ``__main__`` runs its command line
    return sorted(name for name in names if name.rsplit(".", 1)[-1] != "__main__")


MODULES = _module_names()


@functools.cache
def _import(name: str) -> ModuleType | str:
    """The module, or why it cannot be imported here (a missing optional package)."""
    try:
        with warnings.catch_warnings():  # an engine's own import may warn: not this test's concern
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] in OPTIONAL_PACKAGES:
            return f"needs {exc.name}, which is not installed"
        raise


def _kvservice_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class of kvservice the process knows once each module that can
    be imported here has been, by ``module.qualname`` (``kvservice.X`` for those the
    package exports)."""
    for name in MODULES:
        _import(name)
    found: dict[str, type[BaseException]] = {}
    todo: list[type[BaseException]] = [BaseException]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] == "kvservice":
            found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports_unless_an_optional_package_is_missing(name: str) -> None:
    got = _import(name)
    if isinstance(got, str):
        pytest.skip(got)
    assert got.__name__ == name


def test_every_exception_of_kvservice_is_in_the_family() -> None:
    found = _kvservice_exceptions()
    assert KVServiceError in found.values() and TransferFailed in found.values(), sorted(found)
    outside = sorted(name for name, cls in found.items() if not issubclass(cls, KVServiceError))
    assert outside == sorted(INTERNAL), (
        "derive these from KVServiceError (keeping any builtin base callers catch), "
        f"or list them in INTERNAL saying why: {sorted(set(outside) - set(INTERNAL))}")


def test_the_family_check_sees_a_new_exception_class() -> None:
    """The check above fails for a ``class Stray(Exception)`` in a kvservice module."""
    stray = type("Stray", (Exception,), {"__module__": "kvservice._results"})
    seen = _kvservice_exceptions().get("kvservice._results.Stray")
    assert seen is stray and not issubclass(seen, KVServiceError)
    del stray, seen
    gc.collect()  # a class lives in its base's __subclasses__() until it is collected
    assert "kvservice._results.Stray" not in _kvservice_exceptions()


@pytest.mark.parametrize(("cls", "builtin"), [
    (ConfigError, ValueError), (UnknownRequestError, KeyError), (NixlUnavailable, RuntimeError),
    (MetadataError, ValueError), (HandoffError, ValueError), (PeerCredError, OSError),
    (ChildError, RuntimeError), (ControlError, RuntimeError), (DaemonError, RuntimeError),
])
def test_members_keep_the_builtin_base_callers_catch(cls: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(cls, KVServiceError) and issubclass(cls, builtin)
    with pytest.raises(builtin):
        raise cls("why")


def _samples() -> list[BaseException]:
    """Instances of the members whose ``__init__`` takes more than a message."""
    return [
        TransferFailed("r1", FailureReason.TIMEOUT, "no arrival within 5s"),
        ProtocolError("speaks version 9", "version"),
        AuthenticationError("bad proof"),
        IncompatiblePeer("page sizes differ", "theirs: 16 != 32"),
        DoorError(FailureReason.BACKEND, RuntimeError("UCX says no"), "make_prepped_xfer"),
        SidecarRemoteError("ValueError", "pages out of range"),
        Refusal("forged", 401, "the registration's MAC does not verify"),
    ]


def _as_pickled(exc: BaseException) -> BaseException:
    return pickle.loads(pickle.dumps(exc))


def _state(exc: BaseException) -> tuple[type, str, dict[str, str]]:
    return type(exc), str(exc), {k: repr(v) for k, v in vars(exc).items()}


def test_every_member_survives_pickling() -> None:
    """Results (and their ``error``) cross processes: each member rebuilds as it was,
    notes included; one whose ``__init__`` needs more than a message is in ``_samples``."""
    samples = _samples()
    covered = {type(e) for e in samples}
    for cls in _kvservice_exceptions().values():
        if issubclass(cls, KVServiceError) and cls not in covered:
            try:
                samples.append(cls("why"))
            except TypeError as exc:
                pytest.fail(f"{cls.__qualname__} takes more than a message: add an instance to _samples ({exc})")
    for exc in samples:
        exc.add_note("a note")
        assert _state(_as_pickled(exc)) == _state(exc)
    again = _as_pickled(samples[0])
    assert isinstance(again, TransferFailed) and again.reason is FailureReason.TIMEOUT and again.request_id == "r1"


@pytest.mark.parametrize(("exc", "reason"), [
    (KVServiceError("service shut down while connecting"), FailureReason.SHUTDOWN),
    (FrameError("malformed frame"), FailureReason.PEER_LOST),
    (OutboxOverflow("read nothing"), FailureReason.PEER_LOST),
    (ConnectionResetError("reset"), FailureReason.PEER_LOST),
    (AuthenticationError("bad proof"), FailureReason.REFUSED),
    (IncompatiblePeer("page sizes differ", "theirs"), FailureReason.INCOMPATIBLE),
    (DoorError(FailureReason.REMOTE_DISCONNECT, RuntimeError("gone"), "add_remote_agent"),
     FailureReason.REMOTE_DISCONNECT),
])
def test_a_failed_dial_is_classified_as_before_the_family(exc: BaseException, reason: FailureReason) -> None:
    """Only the bare root (the service shutting down) means ``SHUTDOWN``: a broken
    frame in the family is still a lost link."""
    assert dial_failure(exc) is reason


def test_a_refused_call_is_shutdown_only_for_the_bare_root() -> None:
    assert _call_failure(KVServiceError("service is shutting down"))[0] is FailureReason.SHUTDOWN
    assert _call_failure(FrameError("malformed frame"))[0] is FailureReason.REFUSED
