#!/usr/bin/env bash
# Opt-in contract check that imports the real sglang: builds its own venv OUTSIDE the repository
# (default ~/.cache/cpr/contract-venv; CPR_CONTRACT_VENV overrides), installs the pinned sglang wheel
# without its CUDA dependencies plus the pure-Python modules its HTTP server imports, and runs
# tests/testing/test_contract.py with CPR_REQUIRE_SGLANG=1 (an import failure fails, never skips).
# The default test run has the AST check instead (tests/testing/test_contract_wheel.py), which needs none of this.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(python3 -c "import re; print(re.search(r'SGLANG_VERSION = \"([^\"]+)\"', open('resilience/testing/emulator/config.py').read()).group(1))")
VENV=${CPR_CONTRACT_VENV:-$HOME/.cache/cpr/contract-venv}
CACHE=${CPR_WHEEL_CACHE:-$HOME/.cache/cpr/wheels}
PY=${PYTHON:-python3}

case "$(realpath -m "$VENV")" in
  "$(realpath .)"/*) echo "contract.sh: CPR_CONTRACT_VENV must be outside the repository, but was $VENV" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip

mkdir -p "$CACHE"
WHEEL=$(ls "$CACHE"/sglang-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$WHEEL" ]; then
  "$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: "sglang==$VERSION" -d "$CACHE"
  WHEEL=$(ls "$CACHE"/sglang-"$VERSION"-*.whl | head -n1)
fi

# sglang itself without its dependency tree. Its import needs torchvision at module level (0.5.23), and PyPI has
# only CUDA builds of torchvision, which bring their CUDA torch (a few GB, and they import on a CPU): this opt-in
# venv, outside the repository, takes them; the project's own .venv never does (scripts/setup.sh: torch's CPU build).
"$VENV/bin/python" -m pip install -q --no-deps "$WHEEL"
# What sglang.srt.entrypoints.http_server imports at module level (pure Python or manylinux wheels).
"$VENV/bin/python" -m pip install -q fastapi uvicorn orjson pydantic msgspec requests pyyaml pyzmq psutil \
  setproctitle uvloop aiohttp transformers sentencepiece numpy pillow prometheus-client partial-json-parser \
  openai tiktoken interegular packaging einops \
  pybase64 triton ipython dill apache-tvm-ffi compressed_tensors gguf jsonschema xgrammar soundfile python-multipart \
  torchvision
# This project and its test tools, without touching its pins.
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q pytest pytest-timeout pytest-httpserver hypothesis

# Anything still missing shows up as the import error this run fails with; add it to the list above.
CPR_REQUIRE_SGLANG=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/testing/test_contract.py tests/testing/test_contract_wheel.py "$@"
