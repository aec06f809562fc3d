"""The ``kvservice`` command line.  Each subcommand lives in its own module;
this file only wires them up."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from ._exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "main"]


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


COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], int]]] = {
    "bench": ("measure kvservice against raw NIXL, on this host or between two (--listen / --peer)", _bench),
    "cluster": ("the services registered in etcd: name, role, address, incarnation, age, links, in flight",
                _cluster),
    "check-config": ("validate a sidecar config file and print the effective config", _check_config),
    "demo": ("two services, a few dozen verified requests, a decode crash and restart", _demo),
    "keygen": ("write a new cluster key file: kvservice keygen PATH [--force]", _keygen),
    "soak": ("prefill and decodes as processes, N requests, random kills/stops/aborts; counters must stay 0",
             _soak),
    "serve": ("run the sidecar daemon: kvservice serve --config config/prefill.toml", _serve),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvservice", description="KV-cache transfer service over NIXL")
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(
        f"{name}: {desc}" for name, (desc, _) in sorted(COMMANDS.items())))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return EXIT_OK if argv else EXIT_USAGE
    args = parser.parse_args(argv[:1])
    _, run = COMMANDS[args.command]
    # The library logs nothing unless configured (see _log); a command is an application, so
    # warnings and errors go to stderr from here on.  A subcommand with a level of its own
    # (serve's [log], demo's --log-level, soak) configures again.
    from ._log import configure_logging

    configure_logging("warning")
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
