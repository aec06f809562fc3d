#!/usr/bin/env bash
# Create .venv and install kvservice with its test tools.  Idempotent.
# torch==2.13.0 goes first: a CPU build of it is available locally; letting
# pip resolve torch through nixl or kvservice would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"
