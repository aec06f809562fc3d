"""``kvservice keygen PATH [--force]``: write a new cluster key (mode 0600).
``kvservice keygen ca DIR --cluster NAME`` and ``kvservice keygen issue DIR --role ROLE
--name NAME [--out OUT]``: a small authority for member identities (``_trust.authority``);
rotating a member's certificate is issuing it again (``--force``: each file replaced by a
rename, which a running service picks up); ``kvservice keygen revoke DIR (--cert FILE |
--serial N)... [--out LIST]`` adds certificates to the cluster's revocation list
(``revoked_file``).

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
from ._trust.authority import create_authority, issue, revoke, serial_of
from ._trust.keys import generate_key, load_key


def main(argv: Sequence[str]) -> int:
    if argv and argv[0] in ("ca", "issue", "revoke"):  # a key file of that name: ./ca
        return _authority(argv)
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


def _authority(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvservice keygen", description=(
        "A small certificate authority for member identities (identity_cert_file, identity_key_file, "
        "identity_ca_file)."))
    sub = parser.add_subparsers(dest="command", required=True)
    ca = sub.add_parser("ca", help="create the cluster's authority: DIR/ca.crt and DIR/ca.key (0600)")
    ca.add_argument("dir", metavar="DIR")
    ca.add_argument("--cluster", required=True, help="the cluster's name: letters, digits and '-'")
    ca.add_argument("--days", type=int, default=3650)
    ca.add_argument("--force", action="store_true", help="replace an existing authority")
    member = sub.add_parser("issue", help="issue a member's DIR/<name>.crt and <name>.key (0600) from the "
                                          "authority in DIR (again, with --force, to rotate)")
    member.add_argument("dir", metavar="DIR", help="the authority's directory")
    member.add_argument("--role", required=True, help="e.g. prefill, decode")
    member.add_argument("--name", required=True, help="the member's name; its agents are named <name>-<hex>")
    member.add_argument("--out", help="where to write the two files (default: DIR)")
    member.add_argument("--days", type=int, default=90)
    member.add_argument("--force", action="store_true", help="replace the member's files (rotation)")
    gone = sub.add_parser("revoke", help="add certificates to the cluster's revocation list, signed by the "
                                         "authority in DIR (default DIR/revoked.crl; services re-read it)")
    gone.add_argument("dir", metavar="DIR", help="the authority's directory")
    gone.add_argument("--cert", action="append", default=[], help="a member certificate to revoke (repeatable)")
    gone.add_argument("--serial", action="append", default=[], help="a serial number to revoke, hex (repeatable)")
    gone.add_argument("--out", help="the revocation list to write or extend (default: DIR/revoked.crl)")
    gone.add_argument("--days", type=int, default=365, help="the list's next update, in days")
    args = parser.parse_args(argv)
    if args.command == "revoke":
        return _revoke(args)
    if args.days < 1:
        return _fail(EXIT_USAGE, f"--days must be at least 1, got {args.days}")
    try:
        if args.command == "ca":
            path = create_authority(args.dir, args.cluster, days=args.days, force=args.force)
            print(f"wrote the authority of cluster {args.cluster} to {os.path.abspath(args.dir)}\n"
                  f"every member: identity_ca_file = \"{os.path.abspath(path)}\"; keep ca.key off the members")
            return EXIT_OK
        cert, key = issue(args.dir, args.role, args.name, args.out or args.dir, days=args.days, force=args.force)
    except FileExistsError as exc:
        return _fail(EXIT_USAGE, f"{exc.filename} exists; pass --force to replace it")
    except (OSError, ValueError, ConfigError) as exc:
        return _fail(EXIT_FAILED, str(exc))
    print(f"issued member {args.name} ({args.role}) for {args.days} days\n"
          f"identity_cert_file = \"{os.path.abspath(cert)}\"\nidentity_key_file = \"{os.path.abspath(key)}\"")
    return EXIT_OK


def _revoke(args: argparse.Namespace) -> int:
    if not args.cert and not args.serial:
        return _fail(EXIT_USAGE, "name what to revoke: --cert FILE or --serial N")
    try:
        serials = [int(s, 16) for s in args.serial]
    except ValueError:
        return _fail(EXIT_USAGE, f"--serial: {args.serial} are not all hexadecimal serial numbers")
    try:
        serials += [serial_of(cert) for cert in args.cert]
        path, count = revoke(args.dir, serials, args.out, days=args.days)
    except (OSError, ValueError, ConfigError) as exc:
        return _fail(EXIT_FAILED, f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename
                     else str(exc))
    print(f"the revocation list {os.path.abspath(path)} now revokes {count} certificates\n"
          f"every member: revoked_file = \"{os.path.abspath(path)}\" (services re-read it when it changes)")
    return EXIT_OK


def _fail(code: int, message: str) -> int:
    print(f"kvservice keygen: {message}", file=sys.stderr)
    return code
