"""Which key a service authenticates with (``resolve_key``), and key files.

The key is a file's content with surrounding white space removed; it must be at
least ``MIN_KEY_BYTES`` long.  ``generate_key`` writes 32 random bytes as hex
with mode 0600, refusing to overwrite.  Like OpenSSH with private keys,
``load_key`` refuses a file that group or others may read or write, or that
belongs to another user (root excepted).

Without ``auth_key_file`` a service on loopback uses its user's own key
(``user_key``), created on first use in ``user_key_dir``: only processes of that
user (and root) can read it, so another local user's service cannot link.
``allow_unauthenticated`` is the explicit way to run without any key.
"""

from __future__ import annotations

import os
import pwd
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

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
        os.fsync(fd)  # a key that outlives a crash is whole, not empty
    finally:
        os.close(fd)


# -- which key a service uses ------------------------------------------------------------

#: the per-user key's directory below the runtime or config directory, and its name there
USER_KEY_DIR = "kvservice"
USER_KEY_NAME = "key"
USER_KEY_WHAT = "per-user key"
_WAY_OUT = ("set auth_key_file (kvservice keygen PATH) to use a key elsewhere, "
            "or allow_unauthenticated = true to run without one")

KeySource = Literal["auth_key_file", "user", "none"]


@dataclass(frozen=True, slots=True)
class ServiceKey:
    """The key a service authenticates with (None: none) and where it came from."""

    key: bytes | None
    source: KeySource
    path: str | None


def resolve_key(auth_key_file: str | None, *, allow_unauthenticated: bool, loopback: bool,
                env: Mapping[str, str] | None = None) -> ServiceKey:
    """The key of a service so configured: ``auth_key_file`` if set; else none if
    ``allow_unauthenticated``; else, on loopback, this user's key (created on first use).
    ``ConfigError`` naming the problem otherwise."""
    if auth_key_file is not None:
        return ServiceKey(load_key(auth_key_file), "auth_key_file", auth_key_file)
    if allow_unauthenticated:
        return ServiceKey(None, "none", None)
    if not loopback:
        raise ConfigError("auth_key_file: required off loopback (the per-user key is for one host only); "
                          + _WAY_OUT)
    path = os.path.join(user_key_dir(os.environ if env is None else env), USER_KEY_NAME)
    return ServiceKey(user_key(path), "user", path)


def user_key_dir(env: Mapping[str, str]) -> str:
    """``$XDG_RUNTIME_DIR/kvservice`` if that directory is set and this user's, else
    ``$XDG_CONFIG_HOME/kvservice`` or ``~/.config/kvservice``."""
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime) and _is_own_dir(runtime):
        return os.path.join(runtime, USER_KEY_DIR)
    config = env.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(config):  # the XDG spec: a relative path is to be ignored
        config = os.path.join(_home(env), ".config")
    return os.path.join(config, USER_KEY_DIR)


def user_key(path: str) -> bytes:
    """The key in ``path``, written there first (its directory made 0700) if there is
    none.  Safe when several processes of the user start at once: each writes a whole key
    to a file of its own and links it to ``path``, and the first link wins; every one
    then reads the winner's key, through ``load_key``'s checks."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        _check_key_dir(directory)
        if not os.path.lexists(path):
            _create_once(path)
    except OSError as exc:
        raise ConfigError(f"{USER_KEY_WHAT}: cannot create {path!r}: {exc.strerror or exc}; {_WAY_OUT}") from exc
    try:
        return load_key(path, what=USER_KEY_WHAT)
    except ConfigError as exc:  # unreadable, another user's, readable by others, short
        raise ConfigError(f"{exc}; or {_WAY_OUT}") from exc


def _create_once(path: str) -> None:
    temp = f"{path}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    generate_key(temp)
    try:
        os.link(temp, path)  # atomic, never replaces: FileExistsError when another process won
    except FileExistsError:
        pass
    finally:
        os.unlink(temp)


def _check_key_dir(directory: str) -> None:
    """Refuse a directory that others could swap the key in (or that is a link)."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{USER_KEY_WHAT}: {directory!r} is not a directory (or is a symbolic link); {_WAY_OUT}")
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"{USER_KEY_WHAT}: {directory!r} belongs to uid {st.st_uid}, not to this user "
                          f"({os.geteuid()}); {_WAY_OUT}")
    if st.st_mode & 0o022:
        raise ConfigError(f"{USER_KEY_WHAT}: {directory!r} is writable by group or others (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}): chmod 700 {directory}, or {_WAY_OUT}")


def _is_own_dir(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _home(env: Mapping[str, str]) -> str:
    home = env.get("HOME", "")
    if os.path.isabs(home):
        return home
    try:
        return pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError as exc:
        raise ConfigError(f"{USER_KEY_WHAT}: no HOME and no home directory for uid {os.geteuid()}; "
                          f"{_WAY_OUT}") from exc
