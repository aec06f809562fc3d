"""``SidecarStatus``: what ``SidecarClient.status()`` answers, the daemon's service's
``ServiceStatus`` and the daemon's own share (``SidecarServer.status``).  On the wire it
is a map of these names (``StatusReply``), so a daemon of another release is read too:
a name it lacks keeps its default here, one it adds is dropped."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._stats import ServiceStatus


@dataclass(frozen=True, slots=True)
class SidecarStatus(ServiceStatus):
    roles: list[str] = field(default_factory=list)  #: the roles this daemon serves ("prefill", "decode")
    workers: int = 0  #: workers connected
    worker_calls_waiting: int = 0  #: workers' calls waiting on the service (await_* calls)
    #: connections and calls refused, by kind ("uid", "not_owner", "frame", ...)
    workers_refused: dict[str, int] = field(default_factory=dict)
    draining: bool = False  #: shutting down: no new workers or requests
    address: str = ""  #: the service's control address
    agent: str = ""  #: the service's NIXL agent name
