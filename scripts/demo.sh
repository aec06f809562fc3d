#!/usr/bin/env bash
# Set up (if needed) and run the demo: two services, a decode crash, a restart.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvservice demo "$@"
