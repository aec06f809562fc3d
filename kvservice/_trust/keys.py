"""The cluster's shared key: one file per host, readable by its owner only.

The key is the file's content with surrounding white space removed; it must be
at least ``MIN_KEY_BYTES`` long.  ``generate_key`` writes 32 random bytes as hex
with mode 0600, refusing to overwrite.  Like OpenSSH with private keys,
``load_key`` refuses a file that group or others may read or write, or that
belongs to another user (root excepted).
"""

from __future__ import annotations

import os
import secrets
import stat

from .._results import ConfigError

MIN_KEY_BYTES = 32
#: a key file is never larger than this: anything bigger is not a key
MAX_KEY_FILE_BYTES = 4096
KEY_FILE_MODE = 0o600


def load_key(path: str | os.PathLike[str], *, what: str = "auth_key_file") -> bytes:
    """The key in ``path``; ``ConfigError`` naming ``what`` and the problem otherwise."""
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot open {name!r}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what}: {name!r} is not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(
                f"{what}: {name!r} is accessible by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"keys must be private: chmod 600 {name}")
        if st.st_uid not in (os.geteuid(), 0):
            raise ConfigError(f"{what}: {name!r} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"{what}: {name!r} is larger than {MAX_KEY_FILE_BYTES} bytes: not a key file")
    key = data.strip()
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{what}: {name!r} holds {len(key)} bytes; a key has at least {MIN_KEY_BYTES} "
            f"(write one with: kvservice keygen {name})")
    return key


def generate_key(path: str | os.PathLike[str], *, force: bool = False) -> None:
    """Write a fresh key to ``path`` (mode 0600).  ``FileExistsError`` unless ``force``."""
    name = os.fspath(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(name, flags, KEY_FILE_MODE)
    try:
        os.fchmod(fd, KEY_FILE_MODE)  # an existing file keeps its mode otherwise
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
    finally:
        os.close(fd)
