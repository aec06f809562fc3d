"""Checks of every field a peer supplies, before any of it is used.

The control protocol's structs already bound types, lengths and integer ranges
(``_control.protocol``); what is checked here needs context: our own identity, our
layout, and arithmetic over several fields.  Each check returns ``None`` or a
sentence for the ``Reject`` the peer receives.
"""

from __future__ import annotations

import re

from .._control.addresses import is_unspecified_host, split_address
from .._control.protocol import MemoryWire
from ..memory._pairing import compare
from ..memory._regions import KVMemory, memory_from_wire

#: agent names: what ``ServiceConfig.agent_prefix`` plus a uuid produce, with room to spare
AGENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: a peer's descriptor table (one entry per page-plane) is built here and handed to
#: NIXL: bound it, or one Hello could make this process allocate gigabytes
MAX_REMOTE_DESCRIPTORS = 1 << 24


def check_agent(agent: str, own: str) -> str | None:
    if not AGENT_NAME.fullmatch(agent):
        return f"agent name {agent[:140]!r} is not 1-128 of [A-Za-z0-9._-]"
    if agent == own:
        return "a service cannot peer with itself"
    return None


def check_address(address: str) -> str | None:
    try:
        host, _ = split_address(address)
    except ValueError as exc:
        return f"advertised address: {exc}"
    if is_unspecified_host(host):
        return f"advertised address {address!r} cannot be dialled (set advertise_host there)"
    return None


def check_memory(own: KVMemory, wire: MemoryWire) -> tuple[KVMemory | None, str | None, str | None]:
    """The peer's KV memory if its description is usable and compatible with ``own``
    (the same model: layers, regions, heads, dtype, page shape; see ``memory._pairing``);
    else ``None``, why, and the same said from the peer's side ("here" is there) when
    the two are merely different (``None`` when the description itself is unusable)."""
    if wire.regions and len(wire.regions) * wire.num_pages > MAX_REMOTE_DESCRIPTORS:
        return None, (f"{len(wire.regions)} regions x {wire.num_pages} pages exceeds "
                      f"{MAX_REMOTE_DESCRIPTORS} descriptors"), None
    try:
        theirs = memory_from_wire(wire)
    except ValueError as exc:
        return None, f"invalid KV memory: {exc}", None
    why = compare(own, theirs)
    if why is not None:
        return None, f"incompatible KV layout: {why}", f"incompatible KV layout: {compare(theirs, own) or why}"
    return theirs, None, None
