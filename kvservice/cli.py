"""The ``kvservice`` command line.  Each subcommand lives in its own module;
this file only wires them up.

``kvservice --help`` and ``kvservice --version`` import nothing but this module and
``_exits`` (``kvservice/__init__`` loads the public API lazily), so they answer at once:
torch and NIXL are imported by the subcommand that needs them."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Sequence

from . import __version__
from ._exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "main"]


def _demo(argv: Sequence[str]) -> int:
    from .demo import main

    return main(argv)


def _bench(argv: Sequence[str]) -> int:
    from .bench.main import main

    return main(argv)


def _serve(argv: Sequence[str]) -> int:
    from .sidecar.daemon import serve_main

    return serve_main(argv)


def _check_config(argv: Sequence[str]) -> int:
    from .sidecar.daemon import check_config_main

    return check_config_main(argv)


def _soak(argv: Sequence[str]) -> int:
    from .soak import main

    return main(argv)


def _keygen(argv: Sequence[str]) -> int:
    from .keygen import main

    return main(argv)


def _cluster(argv: Sequence[str]) -> int:
    from .discovery.cli import main

    return main(argv)


#: each subcommand: one line of what it does, and the function that runs it
COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], int]]] = {
    "bench": ("measure against raw NIXL, on one host or two (--listen/--peer)", _bench),
    "check-config": ("validate a sidecar config file, print the effective config", _check_config),
    "cluster": ("the services registered in etcd, with their links and load", _cluster),
    "demo": ("two services, verified requests, a decode crash and restart", _demo),
    "keygen": ("write a new cluster key file", _keygen),
    "serve": ("run the sidecar daemon (--config config/prefill.toml)", _serve),
    "soak": ("prefill and decodes as processes, under random faults", _soak),
}

_WIDTH = 78


def command_table() -> str:
    """The subcommands as a two-column table, one description wrapped under its own column."""
    first = max(len(name) for name in COMMANDS) + 4
    lines = []
    for name, (what, _) in sorted(COMMANDS.items()):
        wrapped = textwrap.wrap(what, _WIDTH - first) or [""]
        lines.append(f"  {name:<{first - 2}}{wrapped[0]}")
        lines += [" " * first + more for more in wrapped[1:]]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvservice", usage="kvservice [-h] [--version] COMMAND [ARGS ...]",
        description="kvservice: KV-cache transfer between LLM serving engines over NVIDIA NIXL.",
        epilog=f"commands:\n{command_table()}\n\nRun 'kvservice COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kvservice {__version__}",
                   help="print the version and exit")
    p.add_argument("command", metavar="COMMAND", choices=sorted(COMMANDS), help="one of the commands below")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    if not argv:
        p.print_help(sys.stderr)
        return EXIT_USAGE
    if argv[0].startswith("-"):  # -h, --version, or an option before any command: argparse answers
        p.parse_args(argv)
    args = p.parse_args(argv[:1])
    _, run = COMMANDS[args.command]
    # The library logs nothing unless configured (see _log); a command is an application, so
    # warnings and errors go to stderr from here on.  A subcommand with a level of its own
    # (serve's [log], demo's --log-level, soak) configures again.
    from ._log import configure_logging

    configure_logging("warning")
    try:
        return run(argv[1:])
    except KeyboardInterrupt:  # Ctrl-C: the command cleaned up as it unwound; no traceback
        print(f"kvservice {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
