"""What the watchdog posts for a send: its next chunk, or its settle fence, as a ``PostOp``.

A chunk's post carries its index arrays (the pair's ``Indexer``, or the staging's route:
``staging.Stager.indices``), its notification (``ChunkNotif``: the chunk's number, and on
the last one the count and the request's payload, under the request's notification key) and,
for a request that asked for landing checks, the seal whose sum the door thread computes just
before the WRITE (``landing.seal``).  A fence is one page WRITE into the request's first
destination page, carrying a ``FENCE`` notification: NIXL delivers a WRITE's notification after
flushing the endpoint, so its arrival tells the receiver that every earlier WRITE has landed.

Both run on the event loop, per post: the hot path of every request.
"""

from __future__ import annotations

from .._control.protocol import FENCE, ChunkNotif, encode_notif
from .._nixl.door import PostOp
from . import landing
from .requests import SendRequest
from .staging import Stager


def chunk_post(req: SendRequest, stager: Stager | None) -> PostOp:
    """Take ``req``'s next pending chunk and make its post; ``req`` counts it as posted and
    posting (its digest decrements ``posting``)."""
    kv = req.kv
    assert req.dest is not None and req.peer is not None and kv is not None and kv.indexer is not None
    assert kv.out is not None
    assert req.pending is not None
    chunk = req.pending[0]
    req.pending = req.pending[1:] or None
    src, pos, lo, hi = chunk
    if req.fence_src is None:
        req.fence_src = chunk
    dst = req.dest[pos : pos + src.size]
    prepare = None
    staged = (stager.indices(req, req.peer, req.request_id, kv, src, dst, pos, lo, hi, int(req.dest.size))
              if stager is not None and (kv.gather is not None or kv.scatter is not None) else None)
    if staged is not None:  # _transfer.staging
        local_idx, remote_idx, prepare = staged
    else:
        local_idx, remote_idx = kv.indexer.indices(src, dst, lo, hi)
    number = req.chunks_posted
    req.chunks_posted += 1
    req.posting += 1
    last = req.last and not req.pending
    total = req.chunks_posted if last else 0
    notif = ChunkNotif(req.request_id, number, total, req.payload if last else None)
    op = PostOp(
        key=(req, int(src.size) * kv.out.layer_bytes(hi - lo)),
        peer=req.peer, local_idx=local_idx, remote_idx=remote_idx,
        notif=encode_notif(notif, req.notif_key), prepare=prepare,
    )
    if req.verify:  # its sum is computed on the door thread, just before the WRITE
        landing.seal(op, kv.out, notif, req.notif_key, src, pos, lo, hi)
    return op


def fence_post(req: SendRequest) -> PostOp | None:
    """The settle fence of a failed ``req``: one page WRITE into its first destination page,
    carrying a ``FENCE`` notification; None when ``req`` never posted anything (nothing to
    fence)."""
    fence = req.fence_src
    if (not req.posted or fence is None or req.dest is None or req.peer is None
            or req.kv is None or req.kv.indexer is None):
        return None
    src, pos, lo, _ = fence
    local_idx, remote_idx = req.kv.indexer.indices(src[:1], req.dest[pos : pos + 1], lo, lo + 1)
    return PostOp(key=(req, FENCE), peer=req.peer, local_idx=local_idx, remote_idx=remote_idx,
                  notif=encode_notif(ChunkNotif(req.request_id, FENCE, FENCE), req.notif_key))
