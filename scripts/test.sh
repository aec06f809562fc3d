#!/usr/bin/env bash
# Set up (if needed) and run every check: lint, types, Dockerfile lint, tests.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
fail=0
lint_paths=()
for d in kvservice tests benchmarks examples; do [ -d "$d" ] && lint_paths+=("$d"); done
echo "== ruff";  .venv/bin/ruff check "${lint_paths[@]}" || fail=1
echo "== mypy";  .venv/bin/mypy || fail=1
if [ -f Dockerfile ]; then
    echo "== hadolint"; .venv/bin/hadolint Dockerfile || fail=1
fi
echo "== pytest"
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    rc=1
fi
[ "$rc" -ne 0 ] && fail=1
# The chaos soak with real processes: kills, stops, restarts, aborts, deadlines; its five
# must-be-zero counters decide its exit code (docs/soak.md).
echo "== soak"
.venv/bin/kvservice soak --transfers 1000 --seed "${KVSERVICE_SOAK_SEED:-0}" || fail=1
# The SGLang transfer backend inside SGLang's own classes, in SGLang's own environment
# (built once, cached outside the checkout: scripts/sglang-env.sh; docs/sglang.md).  Required
# here, never skipped; only on a whole run (no pytest arguments given).
if [ "$#" -eq 0 ]; then
    echo "== sglang"
    if sglang_env=$(bash scripts/sglang-env.sh); then
        KVSERVICE_REQUIRE_SGLANG=1 "$sglang_env/bin/python" -m pytest tests/integrations/sglang || fail=1
    else
        echo "scripts/sglang-env.sh failed" >&2
        fail=1
    fi
fi
exit "$fail"
