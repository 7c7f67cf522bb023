#!/usr/bin/env bash
# The vLLM contract check, explicitly: fetch the pinned vllm wheel (~336 MB, `pip download --no-deps`)
# into the cache (~/.cache/cpr/wheels, or $CPR_WHEEL_CACHE) if it is not there, then run
# tests/testing/test_vllm_contract.py against it (the emulator's dev and RL routers against vLLM's, by AST).
# CI (CI=true) fetches the wheel itself in the default test run; a local run without the cache skips
# that module and names this script.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(python3 -c "import re; print(re.search(r'VLLM_VERSION = \"([^\"]+)\"', open('resilience/testing/emulator/vllm/config.py').read()).group(1))")
CACHE=${CPR_WHEEL_CACHE:-$HOME/.cache/cpr/wheels}
PY=${PYTHON:-.venv/bin/python}

mkdir -p "$CACHE"
if ! ls "$CACHE"/vllm-"$VERSION"-*.whl >/dev/null 2>&1; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: "vllm==$VERSION" -d "$CACHE"
fi
CPR_FETCH_VLLM_WHEEL=1 CPR_WHEEL_CACHE="$CACHE" "$PY" -m pytest -q -p no:cacheprovider tests/testing/test_vllm_contract.py "$@"
