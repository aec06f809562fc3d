"""What ``test_forkserver.py``'s forked children run: one behaviour per ``sys.argv[1]``."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    what = sys.argv[1]
    if what == "echo":  # every line of stdin back, with who we are, until stdin ends
        for line in sys.stdin:
            print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "line": line.strip(),
                              "env": os.environ.get("FORK_TEST_VALUE"), "cwd": os.getcwd(),
                              "torch": "torch" in sys.modules}), flush=True)
    elif what == "exit":
        sys.exit(int(sys.argv[2]))
    elif what == "raise":
        raise RuntimeError("raised in the child")
    elif what == "sleep":
        print("{}", flush=True)
        time.sleep(60)
