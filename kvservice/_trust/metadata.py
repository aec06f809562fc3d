"""NIXL agent metadata, read without loading it: the cheap checks before any vetting.

What a peer's ``Join`` carries as ``metadata`` is NIXL's serialised agent, and
``add_remote_agent`` hands its parts to UCX, which unpacks them with assertions
rather than errors (a malformed worker address ends the process with SIGABRT).
This module reads that format the way NIXL does and refuses, with a sentence
for the ``Reject``, anything that is not well formed, before NIXL sees it:

* the ``nixlSerDes|`` framing: each field is a tag, an 8-byte little-endian
  length, that many bytes and a ``|``; every length inside the buffer, nothing
  after the last field;
* ``Agent`` (the name), ``Conns`` (how many backends) and each backend's type
  (``t``) and connection info (``c``): exactly one ``UCX`` among them;
* the UCX worker address (UCX's ``ucp_address_pack``): its header's version must
  be one UCX knows (v1 or v2), anything else is the assertion measured above;
* ``MemSection``: per backend (``bknd``) a descriptor list (``nixlDList`` of kind
  ``nixlSDList``, a 4-byte memory type, an 8-byte count) of descriptors.  Only the
  sections NIXL's UCX backend produces: backend ``UCX``, memory type DRAM or VRAM,
  each at most once (NIXL 1.5 reads a memory type past its last, ``FILE_SEG``, out
  of bounds: that metadata killed the process loading it).  Each descriptor is the
  24-byte ``(addr, len, dev_id)`` followed by the backend's blob; for UCX that
  blob is a packed remote key (UCX's ``ucp_rkey_pack``), which UCX reads without
  a length: its walk (an 8-byte MD map, a memory type, one sized key per MD) must
  fit inside it.

What this cannot judge (the transport-specific device and interface addresses
inside a worker address, what a remote key means to its transport) is proved
harmless by loading it in the vetting child (``vetting``).  Formats as of NIXL
1.5 (``src/utils/serdes``, ``src/core/nixl_agent.cpp``, ``src/infra``) and UCX
1.19 (``src/ucp/wireup/address.c``, ``src/ucp/core/ucp_rkey.c``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .._results import KVServiceError

SERDES_PREFIX = b"nixlSerDes|"
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_SEP = b"|"

#: bounds well above what a NIXL agent with one UCX backend produces
MAX_AGENT_BYTES = 256
MAX_BACKENDS = 8
MAX_CONN_INFO_BYTES = 64 * 1024
#: the sections a UCX agent produces: (backend, memory type), DRAM_SEG = 0 and VRAM_SEG = 1 of
#: NIXL's ``nixl_mem_t``; any other is refused here, before a vetting child ever sees it
SECTION_TYPES = {("UCX", 0): "DRAM", ("UCX", 1): "VRAM"}
MAX_SECTIONS = len(SECTION_TYPES)
#: a descriptor: ``nixlBasicDesc`` (addr, len, dev_id), then the backend's blob
BASIC_DESC_BYTES = 24
MAX_BLOB_BYTES = 4096
#: UCX worker address versions (``ucp_object_version_t``): v1 = 0, v2 = 1, in the header's low 4 bits
UCX_ADDRESS_VERSIONS = (0, 1)
#: UCX memory types (``ucs_memory_type_t``) a remote key may name: host .. gaudi
UCX_MEMORY_TYPES = 10
#: after the keys of a packed remote key: optionally a system device byte, then 3-byte distances
_RKEY_DISTANCE_BYTES = 3


class MetadataError(KVServiceError, ValueError):
    """The metadata is not NIXL's serialised agent in a form this service will load.

    Raised by ``parse_metadata``; ``check_metadata`` turns it into the reason a peer's
    metadata is refused before NIXL ever reads it (that peer's link is refused)."""


@dataclass(frozen=True, slots=True)
class Descriptor:
    addr: int
    length: int
    dev_id: int
    blob: bytes  # the backend's part: for UCX, a packed remote key


@dataclass(frozen=True, slots=True)
class Section:
    backend: str
    mem_type: int
    descriptors: tuple[Descriptor, ...]


@dataclass(frozen=True, slots=True)
class AgentMetadata:
    agent: str
    connections: dict[str, bytes]  # backend type -> its connection info
    sections: tuple[Section, ...]


class _Reader:
    """NIXL's deserialiser, strict: a field is ``tag, u64 length, bytes, '|'``."""

    def __init__(self, data: bytes) -> None:
        if not data.startswith(SERDES_PREFIX):
            raise MetadataError("not NIXL metadata (no nixlSerDes header)")
        self._data = data
        self._at = len(SERDES_PREFIX)

    def field(self, tag: bytes, what: str, limit: int) -> bytes:
        data, at = self._data, self._at
        if data[at : at + len(tag)] != tag:
            raise MetadataError(f"{what}: expected tag {tag.decode()!r} at byte {at}")
        at += len(tag)
        if len(data) < at + _U64.size:
            raise MetadataError(f"{what}: truncated length at byte {at}")
        (n,) = _U64.unpack_from(data, at)
        at += _U64.size
        if n > limit:
            raise MetadataError(f"{what}: {n} bytes, more than {limit}")
        if len(data) < at + n + 1:
            raise MetadataError(f"{what}: {n} bytes and a separator announced, {len(data) - at} left")
        if data[at + n : at + n + 1] != _SEP:
            raise MetadataError(f"{what}: no field separator after {n} bytes")
        self._at = at + n + 1
        return data[at : at + n]

    def integer(self, tag: bytes, what: str, size: int) -> int:
        raw = self.field(tag, what, size)
        if len(raw) != size:
            raise MetadataError(f"{what}: {len(raw)} bytes, expected {size}")
        value: int = (_U64 if size == 8 else _U32).unpack(raw)[0]
        return value

    def text(self, tag: bytes, what: str, limit: int) -> str:
        raw = self.field(tag, what, limit)
        if not raw:
            raise MetadataError(f"{what}: empty")
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError as exc:
            raise MetadataError(f"{what}: not ASCII") from exc

    def end(self) -> None:
        if self._at != len(self._data):
            raise MetadataError(f"{len(self._data) - self._at} bytes after the last field")

    @property
    def left(self) -> int:
        return len(self._data) - self._at


def parse_metadata(data: bytes) -> AgentMetadata:
    """The structure of NIXL's serialised agent ``data``; ``MetadataError`` saying
    what is wrong otherwise (see the module's docstring for what is checked)."""
    r = _Reader(data)
    agent = r.text(b"Agent", "agent name", MAX_AGENT_BYTES)
    count = r.integer(b"Conns", "backend count", 8)
    if not 1 <= count <= MAX_BACKENDS:
        raise MetadataError(f"backend count {count}, expected 1..{MAX_BACKENDS}")
    connections: dict[str, bytes] = {}
    for _ in range(count):
        backend = r.text(b"t", "backend type", 64)
        info = r.field(b"c", f"{backend} connection info", MAX_CONN_INFO_BYTES)
        if not info:
            raise MetadataError(f"{backend} connection info: empty")
        if backend in connections:
            raise MetadataError(f"backend {backend} listed twice")
        connections[backend] = info
    if "UCX" not in connections:
        raise MetadataError(f"no UCX backend (backends: {', '.join(sorted(connections))})")
    check_ucx_address(connections["UCX"])
    if r.field(b"", "memory section marker", 16) != b"MemSection":
        raise MetadataError("memory section marker missing")
    sections = _sections(r)
    r.end()
    return AgentMetadata(agent, connections, sections)


def _sections(r: _Reader) -> tuple[Section, ...]:
    count = r.integer(b"nixlSecElms", "section count", 8)
    if count > MAX_SECTIONS:
        raise MetadataError(f"section count {count}, more than {MAX_SECTIONS}")
    sections: list[Section] = []
    for i in range(count):
        backend = r.text(b"bknd", f"section {i} backend", 64)
        if r.field(b"nixlDList", f"section {i} list kind", 16) != b"nixlSDList":
            raise MetadataError(f"section {i}: not a descriptor list NIXL loads (nixlSDList)")
        mem_type = r.integer(b"t", f"section {i} memory type", 4)
        if (backend, mem_type) not in SECTION_TYPES:
            raise MetadataError(f"section {i}: backend {backend} memory type {mem_type}; a UCX agent's are "
                                + ", ".join(f"{b} {t} ({name})" for (b, t), name in SECTION_TYPES.items()))
        if any(s.backend == backend and s.mem_type == mem_type for s in sections):
            raise MetadataError(f"section {i}: backend {backend} memory type {mem_type} listed twice")
        n = r.integer(b"n", f"section {i} descriptor count", 8)
        # each descriptor takes at least its tag-less header, length and separator
        if n == 0 or n * (_U64.size + BASIC_DESC_BYTES + 1) > r.left:
            raise MetadataError(f"section {i}: {n} descriptors cannot fit in {r.left} bytes")
        descs = []
        for j in range(n):
            raw = r.field(b"", f"section {i} descriptor {j}", BASIC_DESC_BYTES + MAX_BLOB_BYTES)
            if len(raw) <= BASIC_DESC_BYTES:
                raise MetadataError(f"section {i} descriptor {j}: {len(raw)} bytes, no backend blob")
            addr, length, dev_id = struct.unpack_from("<QQQ", raw)
            blob = raw[BASIC_DESC_BYTES:]
            if backend == "UCX":
                check_ucx_rkey(blob)
            descs.append(Descriptor(addr, length, dev_id, blob))
        sections.append(Section(backend, mem_type, tuple(descs)))
    return tuple(sections)


def check_ucx_address(address: bytes) -> None:
    """The header of a packed UCX worker address: a version UCX can unpack.  UCX
    asserts on any other (``addr version N``) and reads the rest without a length."""
    if len(address) < 2:
        raise MetadataError(f"UCX worker address: {len(address)} bytes")
    version = address[0] & 0x0F
    if version not in UCX_ADDRESS_VERSIONS:
        raise MetadataError(f"UCX worker address: version {version}, UCX knows "
                            f"{', '.join(str(v + 1) for v in UCX_ADDRESS_VERSIONS)} (as 0, 1)")


def check_ucx_rkey(blob: bytes) -> None:
    """A packed UCX remote key: an 8-byte MD map, a memory type, then per MD in the
    map a 1-byte size and that many bytes; then at most a system device and
    3-byte distances.  UCX walks it without a length: every step must fit."""
    if len(blob) < _U64.size + 1:
        raise MetadataError(f"UCX remote key: {len(blob)} bytes")
    (md_map,) = _U64.unpack_from(blob)
    if blob[_U64.size] >= UCX_MEMORY_TYPES:
        raise MetadataError(f"UCX remote key: memory type {blob[_U64.size]}")
    at = _U64.size + 1
    for _ in range(md_map.bit_count()):
        if at >= len(blob):
            raise MetadataError(f"UCX remote key: {md_map.bit_count()} MD keys announced, the blob ends at {at}")
        at += 1 + blob[at]
    if at > len(blob):
        raise MetadataError(f"UCX remote key: MD keys run {at - len(blob)} bytes past its end")
    tail = len(blob) - at
    if tail and (tail - 1) % _RKEY_DISTANCE_BYTES:
        raise MetadataError(f"UCX remote key: {tail} trailing bytes are not a device and distances")


def check_metadata(data: bytes) -> str | None:
    """``None`` when ``data`` is well-formed NIXL metadata; else why not."""
    try:
        parse_metadata(data)
    except MetadataError as exc:
        return f"NIXL metadata: {exc}"
    return None
