"""``_nixl.classify``: every NIXL exception class maps to its documented FailureReason."""

from __future__ import annotations

import pytest

from kvservice._nixl.agent import NIXL_ERRORS, classify
from kvservice._nixl.door import DoorError
from kvservice._results import FailureReason

nb = pytest.importorskip("nixl._bindings")

#: the classification documented in kvservice/_nixl.py and the NIXL notes
DOCUMENTED = {
    "nixlRemoteDisconnectError": FailureReason.REMOTE_DISCONNECT,
    "nixlCancelledError": FailureReason.CANCELLED,
    "nixlNotFoundError": FailureReason.PEER_LOST,
    "nixlBackendError": FailureReason.BACKEND,
    "nixlMismatchError": FailureReason.INCOMPATIBLE,
    "nixlInvalidParamError": FailureReason.BACKEND,
    "nixlNotAllowedError": FailureReason.BACKEND,
    "nixlRepostActiveError": FailureReason.BACKEND,
    "nixlNotPostedError": FailureReason.BACKEND,
    "nixlNotSupportedError": FailureReason.BACKEND,
    "nixlUnknownError": FailureReason.BACKEND,
}
#: NIXL classes no door call can raise (telemetry is never read), deliberately unclassified
NOT_RAISED_BY_DOOR_CALLS = {"nixlNoTelemetryError"}


@pytest.mark.parametrize(("name", "reason"), sorted(DOCUMENTED.items()))
def test_each_nixl_error_class(name: str, reason: FailureReason) -> None:
    cls = getattr(nb, name)
    exc = cls("boom")
    assert classify(exc) is reason
    assert cls in NIXL_ERRORS  # the door catches it


def test_every_error_class_of_this_nixl_build_is_accounted_for() -> None:
    """A NIXL upgrade that adds an exception class fails here until it is classified."""
    names = {n for n in dir(nb) if n.startswith("nixl") and n.endswith("Error")}
    assert names == set(DOCUMENTED) | NOT_RAISED_BY_DOOR_CALLS


@pytest.mark.parametrize(
    "exc",
    [RuntimeError("x"), ValueError("x"), Exception("x"), ConnectionResetError("x"),
     DoorError(FailureReason.BACKEND, RuntimeError("x"), "op")],
    ids=lambda e: type(e).__name__,
)
def test_a_non_nixl_exception_is_a_type_error(exc: BaseException) -> None:
    with pytest.raises(TypeError, match=f"not a NIXL error: {type(exc).__name__}"):
        classify(exc)


def test_unclassified_nixl_class_is_not_swallowed() -> None:
    for name in NOT_RAISED_BY_DOOR_CALLS:
        cls = getattr(nb, name)
        assert cls not in NIXL_ERRORS
        with pytest.raises(TypeError):
            classify(cls("x"))
