"""Hosts on a switch: ``kvservice.testing.netns.hub`` (one network namespace per host, each
joined by a veth to a bridge in a namespace of its own, private addresses ``10.214.0.0/24``,
everything removed by the test that made it), with the unplug and plug a partition test
makes.  Needs root and iproute2."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from kvservice.testing.netns import Host, Hub, hub


class Switch:
    def __init__(self, hub: Hub) -> None:
        self._hub = hub
        self.hosts = hub.hosts
        self.netns = hub.netns

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def unplug(self, host: Host) -> None:
        """The host's link down: it loses its carrier and its routes, both directions stop."""
        host.link_down()

    def plug(self, host: Host) -> None:
        host.link_up()
        self._hub.flush_neighbours()  # what the cut left FAILED, on every host


@contextlib.contextmanager
def switch(names: Sequence[str]) -> Iterator[Switch]:
    """One namespace per name (address ``10.214.0.<i+1>``) on a bridge."""
    with hub(names) as h:
        yield Switch(h)
