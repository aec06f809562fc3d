"""``kvservice keygen PATH [--force]``: write a new cluster key (mode 0600).

Every sidecar and service of one cluster reads the same key file
(``[service] auth_key_file`` or ``KVSERVICE_AUTH_KEY_FILE``); peers without it
cannot link.  The file is created with ``O_EXCL`` (an existing key is never
overwritten unless ``--force``) and never through a symbolic link.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence

from ._exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from ._results import ConfigError
from ._trust.keys import generate_key, load_key


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvservice keygen",
        description="Write a new shared key for a cluster of kvservice peers (32 random bytes, hex, mode 0600).")
    parser.add_argument("path", metavar="PATH", help="the key file to create")
    parser.add_argument("--force", action="store_true", help="replace an existing key file")
    args = parser.parse_args(argv)
    path: str = args.path
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return _fail(EXIT_USAGE, f"directory {parent} does not exist")
    try:
        generate_key(path, force=args.force)
    except FileExistsError:
        return _fail(EXIT_USAGE, f"{path} exists; pass --force to replace it (peers holding the old key "
                                 "can no longer link with this one)")
    except IsADirectoryError:
        return _fail(EXIT_USAGE, f"{path} is a directory")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return _fail(EXIT_USAGE, f"{path} is a symbolic link; name the file itself")
        return _fail(EXIT_FAILED, f"cannot write {path}: {exc.strerror or exc}")
    try:
        load_key(path)  # what the services will do with it
    except ConfigError as exc:  # e.g. --force on a file of another user: rewritten, but not ours
        return _fail(EXIT_FAILED, f"wrote {path}, but the services would refuse it: {exc}")
    full = os.path.abspath(path)
    print(f"wrote a new key to {full} (mode 0600)\n"
          f"use it: [service] auth_key_file = \"{full}\" in the sidecar's TOML, or "
          f"KVSERVICE_AUTH_KEY_FILE={full}\n"
          "copy the same file (mode 0600, owned by the user each service runs as) to every host of the cluster")
    return EXIT_OK


def _fail(code: int, message: str) -> int:
    print(f"kvservice keygen: {message}", file=sys.stderr)
    return code
