"""Tensor parallelism on both sides: which prefill ranks feed which decode ranks.

Each rank runs its own ``TransferService`` over its own KV memory, whose
``tp_size``/``tp_rank`` say which of the model's KV heads it holds (the service
exchanges them at the handshake and slices pages accordingly: ``memory._pairing``).
A request ``rid`` becomes one *sub-request* per (prefill rank, decode rank) pair
that shares heads, under the id ``TensorParallel.request_id(rid, p, d)``::

    prefill tp=4 (1 head each)        decode tp=2 (2 heads each)
      rank 0 --rid@tp0.0--------------> rank 0   heads 0-1
      rank 1 --rid@tp1.0------------/
      rank 2 --rid@tp2.1--------------> rank 1   heads 2-3
      rank 3 --rid@tp3.1------------/

    prefill tp=1 (4 heads)            decode tp=2
      rank 0 --rid@tp0.0 (heads 0-1)--> rank 0
             \\-rid@tp0.1 (heads 2-3)--> rank 1

MLA's latent KV is whole on every rank: decode rank *d* is fed by prefill rank
``d * prefill // decode`` alone.

How ranks learn each other: a decode rank needs the control addresses of the
prefill ranks (``senders``, indexed by rank), which the engine's router hands it
with the request as it hands a single sender today; prefill ranks learn the decode
ranks from their Expects.  A decode rank's request succeeds when every source has
delivered; the first source to fail fails it with that source's reason, and the
other sources' sub-requests are aborted (``TPReceive.result``); its pages may be
reused once every sub-request has settled (``TPReceive.settled``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ._results import TransferResult, TransferStatus
from ._transfer.requests import TransferHandle

if TYPE_CHECKING:
    from ._api import Pages
    from ._service import TransferService


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel sizes of the prefill and the decode side (``latent``: MLA)."""

    prefill: int
    decode: int
    latent: bool = False

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TensorParallel.{name} must be a positive int, got {value!r}")

    def sources(self, decode_rank: int) -> list[int]:
        """The prefill ranks that send to ``decode_rank``."""
        self._check(decode_rank, self.decode, "decode")
        if self.latent:
            return [decode_rank * self.prefill // self.decode]
        p, d = self.prefill, self.decode
        return [i for i in range(p) if i * d < (decode_rank + 1) * p and (i + 1) * d > decode_rank * p]

    def targets(self, prefill_rank: int) -> list[int]:
        """The decode ranks ``prefill_rank`` sends to (none: an MLA rank nobody needs)."""
        self._check(prefill_rank, self.prefill, "prefill")
        return [j for j in range(self.decode) if prefill_rank in self.sources(j)]

    @staticmethod
    def request_id(request_id: str, prefill_rank: int, decode_rank: int) -> str:
        """The id of ``request_id``'s sub-request from ``prefill_rank`` to ``decode_rank``."""
        return f"{request_id}@tp{prefill_rank}.{decode_rank}"

    @staticmethod
    def _check(rank: int, size: int, side: str) -> None:
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"{side} rank {rank!r} is not in 0..{size - 1}")

    # -- per rank ---------------------------------------------------------------------
    async def send(self, svc: TransferService, rank: int, request_id: str, pages: Pages,
                   **kwargs: Any) -> list[TransferHandle]:
        """On prefill rank ``rank``: ``svc.send`` of each sub-request (same pages, same
        ``last``/``layers``/``payload``/``timeout``); one handle per target decode rank."""
        return [await svc.send(self.request_id(request_id, rank, j), pages, **kwargs)
                for j in self.targets(rank)]

    async def expect(self, svc: TransferService, rank: int, request_id: str, pages: Pages,
                     senders: Sequence[str], *, timeout: float | None = None) -> TPReceive:
        """On decode rank ``rank``: expect ``request_id`` into ``pages`` from every source
        (``senders[i]``: prefill rank *i*'s control address)."""
        if len(senders) != self.prefill:
            raise ValueError(f"senders: one address per prefill rank ({self.prefill}), got {len(senders)}")
        ids = []
        for i in self.sources(rank):
            rid = self.request_id(request_id, i, rank)
            await svc.expect(rid, pages, sender=senders[i], timeout=timeout)
            ids.append(rid)
        return TPReceive(svc, request_id, ids)


@dataclass
class TPReceive:
    """A decode rank's request, arriving from several prefill ranks."""

    svc: TransferService
    request_id: str
    sub_ids: list[str]

    async def result(self, timeout: float | None = None) -> TransferResult:
        """SUCCESS (the sources' bytes summed; the request's pages; the first source's
        payload) once every source delivered; else the first failure, with the other
        sources aborted."""
        async def arrival(rid: str, results: dict[str, TransferResult]) -> TransferResult:
            result = await self.svc.await_arrival(rid, timeout=timeout)
            if not result.ok:  # the others end ABORTED, after this one
                for other in self.sub_ids:
                    if other not in results and other != rid:
                        await self.svc.abort(other)
            return result

        return await self._each(arrival)

    async def settled(self, timeout: float | None = None) -> TransferResult:
        """The combined result once every sub-request is settled (``await_settled`` of
        each): from then on nothing of any source can land in the pages, so a failed
        request's pages may be reused.  ``timeout``: the result as it stands then (its
        ``settled`` False while some source has not settled)."""
        async def settle(rid: str, results: dict[str, TransferResult]) -> TransferResult:
            return await self.svc.await_settled(rid, timeout=timeout)

        return await self._each(settle)

    async def _each(self, wait: Callable[[str, dict[str, TransferResult]], Awaitable[TransferResult]]
                    ) -> TransferResult:
        """``wait`` for every sub-request at once (it sees the results so far), then combine."""
        results: dict[str, TransferResult] = {}

        async def one(rid: str) -> None:
            results[rid] = await wait(rid, results)

        async with anyio.create_task_group() as tg:
            for rid in self.sub_ids:
                tg.start_soon(one, rid)
        return combine(self.request_id, [results[rid] for rid in self.sub_ids])


def combine(request_id: str, results: Sequence[TransferResult]) -> TransferResult:
    """One result for a request made of sub-requests: the earliest failure, else SUCCESS."""
    failures = sorted((r for r in results if not r.ok), key=lambda r: r.finished_at)
    first = results[0]
    if failures:
        f = failures[0]
        return TransferResult(
            request_id=request_id, status=TransferStatus.FAILED, reason=f.reason, error=f.error,
            message=f"{f.request_id}: {f.message}", created_at=min(r.created_at for r in results),
            started_at=f.started_at, finished_at=max(r.finished_at for r in results),
            settled=all(r.settled for r in results))
    return TransferResult(
        request_id=request_id, status=TransferStatus.SUCCESS, bytes=sum(r.bytes for r in results),
        pages=first.pages, created_at=min(r.created_at for r in results),
        started_at=min((r.started_at for r in results if r.started_at is not None), default=None),
        finished_at=max(r.finished_at for r in results), settled=True, payload=first.payload)
