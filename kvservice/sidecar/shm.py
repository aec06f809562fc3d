"""The KV pool in named shared memory, so workers on the host map the same pages.

The daemon *creates* the segment ``/dev/shm/<name>``: sized with
``posix_fallocate`` (a full ``/dev/shm`` is a clear startup error, not a
``SIGBUS`` on first touch), zeroed (touching every page once makes NIXL's first
copies full speed), mapped, and viewed as a torch tensor shaped like the pool.
While it lives the daemon holds an exclusive ``flock`` on it.  A segment left
behind by a daemon that crashed has no lock holder, so the next daemon with the
same name removes it and starts afresh; a segment whose lock is held belongs to
a running daemon and is refused.

Workers *attach*: they map the same file read-write and get a tensor over the
very same physical pages.  They never lock, create or unlink it.

On a GPU the same design uses CUDA IPC handles instead of a file name; see
docs/sidecar.md ("GPU memory").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import stat
from types import TracebackType

import torch

from .._log import get_logger
from .._results import KVServiceError
from ..memory._layout import KVLayout
from ..memory._pool import torch_dtype

log = get_logger("kvservice.sidecar.shm")

SHM_DIR = "/dev/shm"
#: a segment's name: one file right under SHM_DIR, never a path, never hidden
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class SegmentError(KVServiceError):
    """The shared segment cannot be created or attached; the message says why (no
    ``/dev/shm``, a live daemon holds the name, another user's file, the wrong size).

    Raised by ``Segment.create`` (the daemon does not start) and ``Segment.attach``
    (``SidecarClient`` cannot connect)."""


def check_shm_name(name: str) -> str:
    """``name`` if it names a file right under ``SHM_DIR``; ``ValueError`` otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"letters, digits, '.', '_', '-', starting with a letter or digit "
                         f"(1..200, no '/'), got {name!r}"[:300])
    return name


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, check_shm_name(name))


class Segment:
    """A mapped shared segment and a tensor of ``layout.shape`` over it."""

    def __init__(self, name: str, layout: KVLayout, fd: int, owner: bool) -> None:
        self.name = name
        self.path = segment_path(name)
        self.layout = layout
        self.owner = owner
        self._fd = fd
        self._mmap: mmap.mmap | None = mmap.mmap(fd, layout.pool_bytes)
        flat = torch.frombuffer(self._mmap, dtype=torch_dtype(layout.dtype), count=_numel(layout))
        self.tensor: torch.Tensor | None = flat.view(layout.shape)

    # -- daemon side -----------------------------------------------------------------
    @classmethod
    def create(cls, name: str, layout: KVLayout, *, gid: int | None = None) -> Segment:
        """Create the segment (replacing a stale one); raises ``SegmentError``.

        Mode 0600, or 0660 and group ``gid`` when given (workers of other uids)."""
        path = segment_path(name)
        if not os.path.isdir(SHM_DIR):
            raise SegmentError(f"shared memory: {SHM_DIR} does not exist on this host")
        for _ in range(3):  # bounded: a live owner may race us only so often
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                _remove_if_stale(path)
                continue
            except OSError as exc:
                raise SegmentError(f"shared memory: cannot create {path}: {exc.strerror}") from exc
            break
        else:
            raise SegmentError(f"shared memory: {path} keeps reappearing; another daemon uses the name")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if gid is not None:
                _share_with_group(fd, path, gid)
            _reserve(fd, path, layout.pool_bytes)
            seg = cls(name, layout, fd, owner=True)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        assert seg.tensor is not None
        seg.tensor.zero_()  # tmpfs pages are allocated on first touch: touch them now
        log.info("shm.created", path=path, bytes=layout.pool_bytes)
        return seg

    # -- worker side -----------------------------------------------------------------
    @classmethod
    def attach(cls, name: str, layout: KVLayout, *, owner_uid: int | None = None) -> Segment:
        """Map the daemon's segment ``name``: a regular file (never a link), of the
        pool's size, belonging to ``owner_uid`` when given (the daemon's uid)."""
        try:
            path = segment_path(name)
        except ValueError as exc:
            raise SegmentError(f"shared memory: invalid segment name: {exc}") from exc
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SegmentError(f"shared memory: cannot open {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentError(f"shared memory: {path} is not a regular file")
            if owner_uid is not None and st.st_uid != owner_uid:
                raise SegmentError(f"shared memory: {path} belongs to uid {st.st_uid}, "
                                   f"not to the sidecar's ({owner_uid})")
            size = st.st_size
            if size != layout.pool_bytes:
                raise SegmentError(f"shared memory: {path} has {size} bytes, the pool needs {layout.pool_bytes}")
            return cls(name, layout, fd, owner=False)
        except BaseException:
            os.close(fd)
            raise

    # -- both --------------------------------------------------------------------------
    def unlink(self) -> None:
        """Remove the name (the owner only); mappings stay valid until closed."""
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
                log.info("shm.removed", path=self.path)

    def close(self) -> None:
        """Drop this object's references to the mapping and close the file.  Idempotent.

        The mapping is never unmapped explicitly: torch's storage holds a
        reference to it, so it goes away with the last tensor or view over it,
        and a view that outlives ``close()`` never points at unmapped memory.
        """
        self.tensor = None
        self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)  # also releases the owner's flock
            self._fd = -1

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.unlink()
        self.close()


def _numel(layout: KVLayout) -> int:
    n = 1
    for dim in layout.shape:
        n *= dim
    return n


def _share_with_group(fd: int, path: str, gid: int) -> None:
    try:
        os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o660)
    except OSError as exc:
        raise SegmentError(f"shared memory: cannot give {path} to group {gid}: {exc.strerror}") from exc


def _reserve(fd: int, path: str, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise SegmentError(
                f"shared memory: {SHM_DIR} has no room for {nbytes} bytes "
                "(layout.num_pages too large, or a container's --shm-size too small)") from exc
        raise SegmentError(f"shared memory: cannot size {path}: {exc.strerror}") from exc


def _remove_if_stale(path: str) -> None:
    """Unlink ``path`` unless a live daemon holds its lock (then raise ``SegmentError``)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # gone meanwhile: retry the create
    except OSError as exc:
        raise SegmentError(f"shared memory: {path} exists and cannot be opened: {exc.strerror}") from exc
    try:
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():  # never remove another user's file, even as root
            raise SegmentError(f"shared memory: {path} exists and belongs to uid {owner}, not to this "
                               f"user ({os.geteuid()}); remove it or choose another sidecar.shm_name")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SegmentError(
                f"shared memory: {path} is in use by a running daemon (choose another sidecar.shm_name)"
            ) from None
        os.unlink(path)
        log.warning("shm.stale_removed", path=path)
    finally:
        os.close(fd)
