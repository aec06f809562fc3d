"""kvservice soak: many requests between real processes, faults at random, counters that
must stay zero, and leak accounting for every process.

One prefill and --decodes decode services run as child processes. Requests of random
sizes and chunking (--seed) go from the prefill to a random decode until --transfers
have run or --duration has passed, while the soak SIGKILLs and restarts decodes,
SIGSTOPs and SIGCONTs them, aborts requests from either side and gives some requests
deadlines too short to meet. With --network-cuts (root and iproute2), every process runs
in a network namespace of its own, joined to the others through a bridge, and the faults
include cutting a running decode's network for a while (link down, or every packet it
sends or receives dropped), then restoring it. Every success is verified byte for byte on the receiver;
every failure on a live receiver is awaited until settled, and its pages then hold a
canary that must survive until they are reused or the soak ends.

Through the run, every process's resident memory, open files, threads, TCP connections
and its service's tables (requests, results, ledgers, early expects, peers, NIXL remote
agents and handles) are sampled; the summary reports each after warm-up as start, end
and slope, and a resource that keeps growing fails the soak. See docs/soak.md.

Exit status 0 when false_success, unexplained_disagreements, hung, leaked_handles,
writes_after_settle and crashes are all 0 and nothing grows without bound; 1 otherwise;
2 on bad arguments (or --network-cuts where network namespaces cannot be made).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .._exits import sigterm_as_sigint
from .._runtime import configure_logging, run
from ..testing import netns
from ._run import Options, host_names, soak
from ._summary import MUST_BE_ZERO, Summary, dumps, exit_code, problems, table, unattributed

__all__ = ["MUST_BE_ZERO", "Options", "Summary", "exit_code", "main", "problems", "soak"]


#: --transfers with --duration and no --transfers: the clock ends the run
UNBOUNDED = 1 << 62
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def duration(text: str) -> float:
    """Seconds in ``text``: a number with an optional unit s, m or h (``90s``, ``30m``, ``2h``)."""
    unit = _UNITS.get(text[-1:].lower())
    try:
        seconds = float(text[:-1] if unit is not None else text) * (unit or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no duration: a number with s, m or h (e.g. 30m)") from None
    if not 0 < seconds < 30 * 86400:
        raise argparse.ArgumentTypeError(f"{text!r}: the duration must be above 0 and below 30 days")
    return seconds


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog="kvservice soak", description=__doc__.split("\n\n")[0],
                                     epilog="See docs/soak.md for what each counter and the leak table prove.")
    parser.add_argument("--transfers", type=int, default=None,
                        help="requests to run (default 10000; with --duration: no limit but the time)")
    parser.add_argument("--duration", type=duration, default=None, metavar="D",
                        help="start requests for D once the processes are ready (e.g. 90s, 30m, 2h; "
                             "a bare number is seconds), then finish")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds each request's size, chunking and fault, and the fault schedule (default 0)")
    parser.add_argument("--decodes", type=int, default=2, help="decode processes (default 2, at least 2)")
    parser.add_argument("--concurrency", type=int, default=6, help="requests in flight at once (default 6)")
    parser.add_argument("--max-pages", type=int, default=32, help="largest request, in 16 KiB pages (default 32)")
    parser.add_argument("--fault-interval", type=float, default=1.0,
                        help="mean seconds between process faults; 0 for none (default 1.0)")
    parser.add_argument("--sidecar-decodes", type=int, default=1,
                        help="of the decodes, how many run as a kvservice serve daemon driven by a worker "
                             "(default 1)")
    parser.add_argument("--network-cuts", action="store_true",
                        help="run every process in a network namespace of its own, joined through a bridge, and "
                             "add cuts of a decode's network (0.1-3 s) to the process faults, at equal odds with "
                             "kills and stops (needs root and iproute2)")
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="write the summary's counters and leak verdicts here")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    args = parser.parse_args(list(argv))
    transfers = args.transfers if args.transfers is not None else (10_000 if args.duration is None else UNBOUNDED)
    if (transfers < 1 or args.decodes < 2 or args.concurrency < 1 or not 1 <= args.max_pages <= 128
            or not 0 <= args.sidecar_decodes <= args.decodes or args.fault_interval < 0):
        parser.error("need --transfers >= 1, --decodes >= 2, --concurrency >= 1, 1 <= --max-pages <= 128, "
                     "0 <= --sidecar-decodes <= --decodes, --fault-interval >= 0")
    opts = Options(transfers=transfers, seed=args.seed, decodes=args.decodes, concurrency=args.concurrency,
                   max_pages=args.max_pages, fault_interval_s=args.fault_interval, progress=not args.quiet,
                   sidecar_decodes=args.sidecar_decodes, duration_s=args.duration,
                   network_cuts=args.network_cuts)
    if args.network_cuts:
        why = netns.unavailable()
        if why is not None:
            print(f"kvservice soak: --network-cuts needs network namespaces, but {why}", file=sys.stderr)
            return 2
    configure_logging("error")
    # The children log what the soak provokes (lost peers, aborts): into files, read on failure.
    env = [("KVSERVICE_LOG_LEVEL", "error"), ("NIXL_LOG_LEVEL", "FATAL")]
    logdir = Path(tempfile.mkdtemp(prefix=f"kvservice-soak-{os.getpid()}-"))
    try:
        with open(logdir / "children.log", "w") as log, contextlib.ExitStack() as hosts:
            # the children and namespaces go when the run ends, however it ends (an error,
            # Ctrl-C, SIGTERM): SIGTERM's default would leave a child stopped by a fault
            # stopped for good, its namespace with it.  SIGTERM is made a SIGINT, so that the
            # event loop's own handler cancels the run; a KeyboardInterrupt raised by the
            # signal inside a task was also logged, with its traceback, as the loop shut down
            hosts.enter_context(sigterm_as_sigint())
            net = hosts.enter_context(netns.hub(host_names(opts))) if opts.network_cuts else None
            summary = run(soak, opts, log, env, net)
    except KeyboardInterrupt:  # an interrupted run judges nothing: its log goes too
        shutil.rmtree(logdir, ignore_errors=True)
        raise
    data = summary.as_json()
    print(table(summary))
    bad = problems(data)
    for note in summary.notes:
        print(f"note: {note}")
    if args.json is not None:
        args.json.write_text(dumps(summary) + "\n")
    if bad:
        print(f"soak FAILED: {'; '.join(bad)}; the children's log is in {logdir}")
    else:
        print("soak: every counter that must be zero is zero, and nothing grows without bound")
        if odd := unattributed(data):
            print(f"soak: failures no fault explains ({', '.join(odd)}): the children's log is kept in {logdir}")
        else:
            shutil.rmtree(logdir, ignore_errors=True)
    return exit_code(data)
