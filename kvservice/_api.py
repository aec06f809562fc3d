"""``KVTransfer``: the one API of kvservice, in process or through a sidecar.

``TransferService`` (this process owns the NIXL agent) and ``SidecarClient`` (a
``kvservice serve`` daemon owns it) both satisfy this protocol, so code written
against it runs with either; ``kvservice/_api_check.py`` assigns each to it, and
mypy fails the build when one drifts (a parameter renamed, a method made async).

The handle type is the protocol's parameter: ``send`` returns it and
``await_completion`` takes it back (``TransferHandle`` in process, ``SidecarHandle``
through the sidecar; both a ``HandleBase``).  Code that takes either writes
``KVTransfer[Any]``.

What is here, and what is not, on purpose:

* every call a worker makes for a request, with the same names, defaults, errors and
  ``TransferResult`` values, and the same sync/async split: what waits is a coroutine;
  ``poll_arrival`` and ``status`` never block, and through the sidecar answer from what
  the client holds (the daemon's latest word: its replies, its ``Finished`` frames and
  the status it refreshes);
* the scheduler's reads, on purpose: ``expected``, ``expected_pages`` and
  ``expect_dropped`` (a receiver's expect held before the first ``send()``) and
  ``live_peers`` (the cluster's members).  What they read no worker's request owns (an
  expect arrives from a peer before any worker sends its id; membership), so through the
  sidecar each is a call to the daemon, and what waits is a coroutine: on both faces.
  In process they return at once; a scheduler's thread reads them through the engine
  facade (``kvservice.engine``), whose calls are all plain, never-blocking reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal, NamedTuple, Protocol, Self, TypeVar

import numpy.typing as npt

from ._results import FailureReason, KVPoll, TransferResult
from ._stats import ServiceStatus
from ._transfer.requests import HandleBase
from .discovery.member import Member
from .memory._layout import KVLayout
from .memory._pool import KVPool

__all__ = ["EarlyExpect", "KVTransfer", "Pages"]

#: pages of the KV pool: indices, as a sequence or a NumPy array
Pages = Sequence[int] | npt.NDArray[Any]

H = TypeVar("H", bound=HandleBase)


class EarlyExpect(NamedTuple):
    """What a sender knows of a receiver's expect for one request before its first ``send()``
    (``expected``, ``expected_pages``, ``expect_dropped``, read at once)."""

    expected: bool  #: an expect is here, held for the first send()
    pages: int | None  #: the pages that receiver reserved (None: no expect held)
    dropped: tuple[FailureReason, str] | None  #: it came and was dropped: (why, whose)


class KVTransfer(Protocol[H]):
    """What a prefill or decode worker calls to move a request's KV pages.

    Use as ``async with``; ``TransferService``'s docstrings say what each call does."""

    layout: KVLayout  #: the shape of the KV pool
    address: str  #: the control address ("host:port"): what a receiver passes as ``sender``
    agent_name: str  #: the NIXL agent's name

    @property
    def kv(self) -> KVPool:
        """The KV pool this worker writes (sender) or reads (receiver) pages of."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool: ...

    # -- sending side ------------------------------------------------------------------------
    async def send(self, request_id: str, pages: Pages, *, last: bool = False,
                   timeout: float | None = None, receiver: str | None = None,
                   layers: range | None = None, payload: bytes | None = None,
                   fit: Literal["tail"] | None = None) -> H: ...

    async def await_completion(self, handle: H, timeout: float | None = None) -> TransferResult: ...

    # -- receiving side ----------------------------------------------------------------------
    async def expect(self, request_id: str, pages: Pages, *, sender: str,
                     timeout: float | None = None, verify: bool | None = None,
                     member: str | None = None) -> None: ...

    async def decline(self, request_id: str, *, sender: str, message: str = "") -> bool: ...

    async def await_arrival(self, request_id: str, timeout: float | None = None) -> TransferResult: ...

    async def await_settled(self, request_id: str, timeout: float | None = None) -> TransferResult: ...

    def poll_arrival(self, request_id: str) -> KVPoll: ...

    # -- the scheduler's reads: a receiver's expect before the first send(); membership ---
    async def expected(self, request_id: str) -> bool: ...

    async def expected_pages(self, request_id: str) -> int | None: ...

    async def expect_dropped(self, request_id: str) -> tuple[FailureReason, str] | None: ...

    async def live_peers(self, role: str | None = None) -> list[Member]: ...

    # -- either side -------------------------------------------------------------------------
    async def abort(self, request_id: str) -> TransferResult | None: ...

    def status(self) -> ServiceStatus: ...
