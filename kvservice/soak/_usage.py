"""What ``/proc`` says one soak process holds: resident memory, file descriptors,
threads, established TCP connections (Linux only; the leak accounting's process rows).

UCX over TCP on loopback opens one connection per endpoint, and each control link is one
more: their count is where UCX endpoints are visible from outside the process."""

from __future__ import annotations

import os

from ..bench.procfs import rss_mib

_ESTABLISHED = "01"


def established_inodes(text: str) -> set[str]:
    """The socket inodes of the ESTABLISHED rows of ``/proc/PID/net/tcp`` or ``tcp6`` text."""
    out = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[3] == _ESTABLISHED:
            out.add(fields[9])
    return out


def net_namespace(pid: int | str = "self") -> int:
    """The inode of ``pid``'s network namespace: equal for processes sharing one.  ``OSError``
    if ``pid`` is gone."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def established(pid: int | str = "self") -> set[str]:
    """The socket inodes of the established TCP connections of ``pid``'s network namespace
    (``/proc/PID/net/tcp``: the table of the namespace the process lives in, which may not
    be this one's).  Read once per sample for every namespace: the kernel writes the whole
    table for each read (milliseconds with a few hundred sockets).  ``OSError`` if ``pid``
    is gone."""
    out: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                out |= established_inodes(f.read())
        except FileNotFoundError:  # no IPv6
            continue
    return out


def usage(pid: int, tcp: set[str]) -> dict[str, float]:
    """``rss_mib``, ``fds``, ``threads`` of ``pid`` now and ``tcp``: how many of its sockets
    are in ``tcp`` (``established()`` of its network namespace).  ``OSError`` if
    ``pid`` is gone."""
    sockets = set()
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            sockets.add(target[8:-1])
    return {"rss_mib": round(rss_mib(pid), 1), "fds": fds, "threads": len(os.listdir(f"/proc/{pid}/task")),
            "tcp": len(sockets & tcp)}
