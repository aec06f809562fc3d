#!/usr/bin/env bash
# Build (once) and print the path of a Python environment with SGLang 0.5.23 and its own torch
# pin (2.14.1, which runs on CPU), for the SGLang backend's tests and for trying it by hand.
# The environment is cached outside the checkout, keyed by this script's contents (which
# name every package it installs), so a fresh clone reuses it.
#
#   SGLANG_PY=$(bash scripts/sglang-env.sh)/bin/python
#
# kvservice itself is not installed into it: run it with PYTHONPATH=<checkout>, so the
# environment serves every checkout.  Its dependencies are installed.  The backend reaches
# SGLang as a plugin (entry-point group sglang.srt.plugins), and an entry point needs an
# installed distribution: a tiny one, kvservice-sglang-plugin, names only the entry point
# (kvservice.integrations.sglang.plugin:register) and carries no code.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CACHE=${KVSERVICE_ENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvservice/envs}
KEY=$(sha256sum scripts/sglang-env.sh | cut -c1-12)
ENV="$CACHE/sglang-$KEY"
if [ -f "$ENV/.complete" ]; then
    echo "$ENV"
    exit 0
fi
mkdir -p "$CACHE"
rm -rf "$ENV"
{
    "$PY" -m venv "$ENV"
    "$ENV/bin/python" -m pip install --quiet --upgrade pip
    # torch first: SGLang 0.5.23 pins torch 2.14.1 and torchvision 0.29.1 (both on local disk).
    "$ENV/bin/python" -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
    constraints=$(mktemp)
    printf 'torch==2.14.1\ntorchvision==0.29.1\n' >"$constraints"
    "$ENV/bin/python" -m pip install --quiet -c "$constraints" "sglang==0.5.23"
    # kvservice's own dependencies and test tools (kvservice is on PYTHONPATH, not installed).
    "$ENV/bin/python" -m pip install --quiet -c "$constraints" \
        "nixl>=1.5,<2" "anyio>=4.4" "uvloop>=0.19" "structlog>=24.1" "msgspec>=0.18" \
        "prometheus_client>=0.20" "cryptography>=42" "pytest>=8" "pytest-asyncio>=0.24" "pytest-timeout>=2.3"
    rm -f "$constraints"
    # The plugin's entry point: a distribution of metadata only, written here (no code in it).
    site=$("$ENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    dist="$site/kvservice_sglang_plugin-0.1.0.dist-info"
    mkdir -p "$dist"
    printf 'Metadata-Version: 2.1\nName: kvservice-sglang-plugin\nVersion: 0.1.0\n' >"$dist/METADATA"
    printf '[sglang.srt.plugins]\nkvservice = kvservice.integrations.sglang.plugin:register\n' \
        >"$dist/entry_points.txt"
    printf 'kvservice_sglang_plugin-0.1.0.dist-info/METADATA,,\nkvservice_sglang_plugin-0.1.0.dist-info/entry_points.txt,,\nkvservice_sglang_plugin-0.1.0.dist-info/RECORD,,\n' \
        >"$dist/RECORD"
    "$ENV/bin/python" -c "import sglang, nixl, torch; assert torch.__version__.startswith('2.14.1')"
    "$ENV/bin/python" -c "import sglang.srt.disaggregation.utils, sglang.srt.disaggregation.nixl.conn"
} >&2
touch "$ENV/.complete"
echo "$ENV"
