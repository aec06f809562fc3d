"""A poll-style facade over ``TransferService`` for synchronous schedulers.

A scheduler that never awaits (SGLang's and vLLM's both call ``poll()`` between
forward steps) drives transfers with these objects; the service runs on an event
loop of its own thread.  See docs/engine-facade.md for the call-by-call mapping to
SGLang's ``BaseKVSender`` / ``BaseKVReceiver``::

    with KVTransferEngine(config) as engine:
        sender = engine.sender("req-1")
        sender.init(num_pages=3)
        sender.send([0, 1])
        sender.send([2])                # reaches num_pages: the last chunk
        ...                             # forward steps
        if sender.poll() is KVPoll.Failed:
            sender.failure_exception()  # TransferFailed: reason, peer; the original error as __cause__
        sender.clear()
"""

from .._results import KVPoll
from ._engine import KVTransferEngine
from ._transfers import KVReceiver, KVSender

__all__ = ["KVPoll", "KVReceiver", "KVSender", "KVTransferEngine"]
