"""``_trust.metadata``: NIXL's serialised agent read without loading it.

The metadata here is written field by field as NIXL 1.5 writes it (``nixlSerDes``:
tag, u64 length, bytes, ``|``), so the parser is checked against the format, not
against itself; ``tests/faults/test_metadata_fuzz.py`` feeds it a real agent's."""

from __future__ import annotations

import struct

import pytest

from kvservice._trust.metadata import (
    MAX_BACKENDS,
    MetadataError,
    check_metadata,
    check_ucx_rkey,
    parse_metadata,
)

AGENT = "kv-unit-0123456789ab"
#: a UCX v1 worker address: header (version 0, flags 0x2 = worker uuid), uuid, one device
ADDRESS = bytes([0x20]) + bytes(range(8)) + b"\x01\x02\x03\x04" * 8
#: a packed remote key: MD map {0, 2}, host memory, two sized keys, a system device byte
RKEY = struct.pack("<Q", 0b101) + b"\x00" + b"\x02ab" + b"\x03xyz" + b"\xff"


def field(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<Q", len(value)) + value + b"|"


def descriptor(addr: int = 0x7F0000000000, length: int = 1 << 20, blob: bytes = RKEY) -> bytes:
    return field(b"", struct.pack("<QQQ", addr, length, 0) + blob)


def metadata(*, agent: str = AGENT, backends: list[tuple[bytes, bytes]] | None = None, count: int | None = None,
             marker: bytes = b"MemSection", sections: bytes | None = None) -> bytes:
    backends = [(b"UCX", ADDRESS)] if backends is None else backends
    out = b"nixlSerDes|" + field(b"Agent", agent.encode())
    out += field(b"Conns", struct.pack("<Q", len(backends) if count is None else count))
    for kind, info in backends:
        out += field(b"t", kind) + field(b"c", info)
    out += field(b"", marker)
    return out + (section_list() if sections is None else sections)


def section(*descs: bytes, kind: bytes = b"nixlSDList", n: int | None = None, mem_type: int = 0,
            backend: bytes = b"UCX") -> bytes:
    descs = descs or (descriptor(),)
    body = field(b"bknd", backend) + field(b"nixlDList", kind) + field(b"t", struct.pack("<I", mem_type))
    return body + field(b"n", struct.pack("<Q", len(descs) if n is None else n)) + b"".join(descs)


def section_list(*descs: bytes, kind: bytes = b"nixlSDList", count: int | None = None,
                 n: int | None = None, mem_type: int = 0, backend: bytes = b"UCX") -> bytes:
    body = section(*descs, kind=kind, n=n, mem_type=mem_type, backend=backend)
    return field(b"nixlSecElms", struct.pack("<Q", 1 if count is None else count)) + body


def test_reads_what_nixl_writes() -> None:
    md = parse_metadata(metadata())
    assert md.agent == AGENT
    assert md.connections == {"UCX": ADDRESS}
    (section,) = md.sections
    assert (section.backend, section.mem_type) == ("UCX", 0)
    (desc,) = section.descriptors
    assert (desc.addr, desc.length, desc.dev_id, desc.blob) == (0x7F0000000000, 1 << 20, 0, RKEY)
    assert check_metadata(metadata()) is None
    # an agent before it registered memory: no sections; another backend beside UCX
    assert parse_metadata(metadata(sections=field(b"nixlSecElms", struct.pack("<Q", 0)))).sections == ()
    assert check_metadata(metadata(backends=[(b"POSIX", b"x"), (b"UCX", ADDRESS)])) is None


@pytest.mark.parametrize("version", [0, 1])
def test_ucx_address_versions_ucx_knows_pass(version: int) -> None:
    address = bytes([0x20 | version]) + ADDRESS[1:]
    assert check_metadata(metadata(backends=[(b"UCX", address)])) is None


@pytest.mark.parametrize("version", range(2, 16))
def test_any_other_ucx_address_version_is_refused(version: int) -> None:
    """The measured abort: UCX asserts ``addr_version == V2`` for anything but v1."""
    address = bytes([0x20 | version]) + ADDRESS[1:]
    why = check_metadata(metadata(backends=[(b"UCX", address)]))
    assert why is not None and f"version {version}" in why


def test_every_truncation_and_any_extra_byte_is_refused() -> None:
    good = metadata()
    for cut in range(len(good)):
        assert check_metadata(good[:cut]) is not None, cut
    assert "after the last field" in (check_metadata(good + b"x") or "")
    assert check_metadata(good + b"\x00" * 100) is not None


@pytest.mark.parametrize(("data", "says"), [
    (b"not nixl", "no nixlSerDes header"),
    (metadata().replace(b"Agent", b"Agenx", 1), "expected tag 'Agent'"),
    (metadata(agent="x" * 300), "more than 256"),
    (metadata(agent="k\u00e9"), "not ASCII"),
    (metadata(count=0, backends=[]), "backend count 0"),
    (metadata(count=MAX_BACKENDS + 1), f"backend count {MAX_BACKENDS + 1}"),
    (metadata(count=2), "expected tag 't'"),  # announces two, carries one
    (metadata(backends=[(b"POSIX", b"x")]), "no UCX backend"),
    (metadata(backends=[(b"UCX", ADDRESS), (b"UCX", ADDRESS)]), "listed twice"),
    (metadata(backends=[(b"UCX", b"")]), "empty"),
    (metadata(backends=[(b"UCX", b"\x20")]), "UCX worker address: 1 bytes"),
    (metadata(marker=b"Elsewhere"), "memory section marker missing"),
    (metadata(sections=section_list(kind=b"nixlBDList")), "nixlSDList"),
    (metadata(sections=section_list(count=3)), "section count 3"),
    (metadata(sections=section_list(n=0)), "0 descriptors"),
    (metadata(sections=section_list(n=1 << 40)), "cannot fit"),
    (metadata(sections=section_list(descriptor(blob=b""))), "no backend blob"),
])
def test_malformed_fields_are_refused_with_a_reason(data: bytes, says: str) -> None:
    why = check_metadata(data)
    assert why is not None and says in why, why


@pytest.mark.parametrize(("mem_type", "backend"), [(2, b"UCX"), (4, b"UCX"), (5, b"UCX"), (0xFFFFFFFF, b"UCX"),
                                                   (0, b"POSIX")])
def test_sections_a_ucx_agent_never_writes_are_refused(mem_type: int, backend: bytes) -> None:
    """NIXL 1.5 reads a memory type past ``FILE_SEG`` (4) out of bounds: such a section killed
    the process loading it.  Only UCX's DRAM and VRAM sections pass, each once."""
    why = check_metadata(metadata(backends=[(b"UCX", ADDRESS), (b"POSIX", b"x")],
                                  sections=section_list(mem_type=mem_type, backend=backend)))
    assert why is not None and f"memory type {mem_type}" in why, why


def test_a_dram_and_a_vram_section_pass_and_a_repeated_one_is_refused() -> None:
    two = field(b"nixlSecElms", struct.pack("<Q", 2))
    md = parse_metadata(metadata(sections=two + section(mem_type=0) + section(mem_type=1)))
    assert [s.mem_type for s in md.sections] == [0, 1]
    why = check_metadata(metadata(sections=two + section(mem_type=1) + section(mem_type=1)))
    assert why is not None and "listed twice" in why, why


def test_length_fields_that_lie_are_refused() -> None:
    good = metadata()
    at = good.index(b"Agent") + len(b"Agent")
    for n in (len(AGENT) - 1, len(AGENT) + 1, 1 << 63, (1 << 64) - 1):
        lying = good[:at] + struct.pack("<Q", n) + good[at + 8:]
        assert check_metadata(lying) is not None, n
    at = good.index(ADDRESS) - 8
    for n in (0, len(ADDRESS) - 1, len(ADDRESS) + 1, 1 << 62):
        assert check_metadata(good[:at] + struct.pack("<Q", n) + good[at + 8:]) is not None, n


@pytest.mark.parametrize(("blob", "says"), [
    (b"\x01" * 8, "8 bytes"),
    (struct.pack("<Q", 1) + b"\x0a" + b"\x00", "memory type 10"),
    (struct.pack("<Q", 0b11) + b"\x00" + b"\x00", "2 MD keys announced"),
    (struct.pack("<Q", 1) + b"\x00" + b"\x05ab", "past its end"),
    (struct.pack("<Q", (1 << 64) - 1) + b"\x00" + b"\x00" * 10, "64 MD keys announced"),
    (struct.pack("<Q", 1) + b"\x00" + b"\x00" + b"\xff\x01", "trailing"),
])
def test_remote_keys_whose_walk_leaves_the_blob_are_refused(blob: bytes, says: str) -> None:
    with pytest.raises(MetadataError, match=says):
        check_ucx_rkey(blob)
    assert check_metadata(metadata(sections=section_list(descriptor(blob=blob)))) is not None


def test_remote_keys_nixl_writes_pass() -> None:
    check_ucx_rkey(RKEY)
    check_ucx_rkey(struct.pack("<Q", 1) + b"\x00" + b"\x00" + b"\xff")  # what a DRAM pool here packs
    check_ucx_rkey(struct.pack("<Q", 1) + b"\x00" + b"\x00")  # no system device
    check_ucx_rkey(struct.pack("<Q", 1) + b"\x00" + b"\x00" + b"\x01" + b"\x02\x03\x04")  # and one distance
