"""Doubles for testing against kvservice: peers in child processes, and NIXL faked.

For an engine team testing its integration with kvservice on machines without GPUs
(or without a second host), and for kvservice's own tests.  Two kinds of stand-in:

* **A real peer in a child process.**  ``PeerProcess`` starts ``python -m
  kvservice.testing.peer``: a whole ``TransferService`` with its own NIXL agent,
  driven by JSON lines (fill pages, send, expect, verify, abort, status), so the
  other side of an engine's transfers is a process a test can SIGKILL, SIGSTOP and
  restart.  ``peer_config`` writes its configuration; ``peer_processes`` starts
  several and stops them on exit.
* **NIXL faked in process.**  ``FakeFabric`` and its ``FakeDoor``s stand in for NIXL
  behind ``TransferService(..., door_factory=fabric.factory)``: bytes move by
  ``memmove`` within one process, failures and hangs are scripted, and every handle
  is accounted for (``FakeFabric.assert_clean``).

``pattern`` and ``holds`` give every request id its own deterministic page contents,
so a receiver verifies every byte without a checksum from the sender.

``engine_process`` holds both ends of the JSON-line pipe to an engine in a child process
(the vLLM tests and ``benchmarks.vllm_pd`` run theirs so); it imports no engine.

``kvservice.testing.netns`` makes hosts out of network namespaces (two on a veth,
``wire``, or many on a bridge, ``hub``; root and iproute2) and cuts and restores their
links: the soak's ``--network-cuts`` and the suite's partition tests run on it.

``kvservice.testing.inspect.inside(svc)`` is what a test sees of a running service beyond
its API (its request and control planes, its links, its early expects, its door and
vetter), and the pushes a failure-path test makes (drop a link, hear what it is told):
tests read a service's private state there, never through its attributes.

What is stable: the names in ``__all__``, the peer's commands and events
(``kvservice.testing.peer``) and ``FakeDoor``'s scripting calls.  The rest of the
modules here (``Mode``, ``PostRecord``, the fake's counters) serve kvservice's own
tests and may change with them.

What belongs here: what a user of the package needs to test an integration with kvservice.
The suite's own harness (configurations with its defaults, shared ports, hostile peers built
from kvservice's private protocol, the unit tests' service pairs) lives under ``tests/``
(docs/testing.md, "Where a double lives"); a double moves here when a user's test needs it,
and nothing lives in both.

The service never depends on its doubles: ``import kvservice`` does not import this
package, and nothing under ``kvservice`` does but the ``demo`` and ``soak`` commands,
which run their peers as child processes through it.
"""

from .fake_door import FakeDoor, FakeFabric
from .pages import holds, pattern
from .peer_process import PeerProcess, peer_config, peer_processes

__all__ = [
    "FakeDoor",
    "FakeFabric",
    "PeerProcess",
    "holds",
    "pattern",
    "peer_config",
    "peer_processes",
]

# Say where to import them from (``kvservice.testing.FakeDoor``), not where they live.
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
