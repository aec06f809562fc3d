"""How busy the sender's NIXL thread is, and what one post costs on it: a diagnostic.

    .venv/bin/python -m benchmarks.door_ticks --case w3/c256 --repeats 2

Runs ``benchmarks.cpu`` (raw NIXL and kvservice on one case) with every watchdog tick of
kvservice's sender recorded on its NIXL thread (``sitecustomize.py`` here, loaded by that
process alone), then reports over the last measured run: the share of its wall time the
NIXL thread spent in ticks, and per post the tick's wall and CPU time and the time inside
the post calls (``make_prepped_xfer`` + ``transfer``), beside raw NIXL's whole request.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def report(ticks: list[list[float]], window_s: float) -> str:
    posting = [t for t in ticks if t[3] > 0]
    if not posting:
        return "no tick posted anything"
    end = posting[-1][1]
    win = [t for t in ticks if t[0] > end - window_s]
    span = win[-1][1] - win[0][0]
    posts = sum(int(t[3]) for t in win)
    busy = sum(t[1] - t[0] for t in win)
    return (f"last {span * 1e3:.0f} ms: {len(win)} ticks, {posts} posts; NIXL thread in ticks "
            f"{100 * busy / span:.0f} % of the time; per post: tick wall "
            f"{busy / posts * 1e6:.0f} us, tick CPU {sum(t[2] for t in win) / posts * 1e6:.0f} us, "
            f"post calls {sum(t[4] for t in win) / posts * 1e6:.0f} us")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.door_ticks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="w3/c256")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--window-s", type=float, default=0.3, help="how much of the end to look at")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvservice-door-ticks-") as out:
        env = {**os.environ, "KVSERVICE_DOOR_TICKS_OUT": out,
               "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-m", "benchmarks.cpu", "--cases", args.case, "--repeats",
                        str(args.repeats), "--methods", "raw_nixl,kvservice"], env=env, check=True, cwd=REPO)
        files = glob.glob(os.path.join(out, "send-*.json"))
        if not files:
            raise SystemExit("the sender recorded no ticks")
        with open(files[0]) as f:
            print(report(json.load(f), args.window_s))


if __name__ == "__main__":
    main()
