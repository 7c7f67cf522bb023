#!/usr/bin/env bash
# Set up everything the project needs on a fresh Debian machine: Prometheus
# (promtool + server, for the alerting tests) and the virtualenv in .venv.
# Idempotent: a second run only checks. The Python steps stamp .venv with the hash of pyproject.toml and this
# script; while the stamp matches and the packages they install are found (ours from this checkout), pip is not run.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends prometheus
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.cpr-setup-stamp
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
VERL_SRC=${CPR_VERL_SOURCE:-$HOME/.cache/cpr/verl}
SKYRL_SRC=${CPR_SKYRL_SOURCE:-$HOME/.cache/cpr/skyrl}
SKYRL_FILE=skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py
installed() {  # the stamp matches, and everything the steps below install is there, resilience from this checkout
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
    && [ -f "$VERL_SRC/verl/workers/rollout/sglang_rollout/http_server_engine.py" ] \
    && [ -f "$SKYRL_SRC/$SKYRL_FILE" ] \
    && .venv/bin/python - <<'PY' 2>/dev/null
import importlib.util
import pathlib
import sys

# found, not imported (importing torch alone takes seconds): the [dev,docs,frameworks] extras, torch, AReaL
missing = [name for name in ("areal", "mkdocs", "pytest", "smg", "torch") if importlib.util.find_spec(name) is None]
ours = importlib.util.find_spec("resilience")
here = ours is not None and ours.origin is not None and pathlib.Path(ours.origin).resolve().parent == pathlib.Path("resilience").resolve()
sys.exit(bool(missing) or not here)
PY
}
if installed; then
  echo "setup: .venv is up to date with pyproject.toml ($STAMP): nothing installed"
  exit 0
fi
rm -f "$STAMP"
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned to the local CPU build, so nothing pulls a CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
# [docs]: MkDocs, Material and mkdocstrings, pinned, for scripts/test.sh's strict docs build.
.venv/bin/python -m pip install -q -e '.[dev,docs,frameworks]'
# [dev] pulls [all], which has [smg] (the smg gateway for tests/smg: CI=true fails them without it); checked here
# because a wheel that did not install (no wheel for this platform) must stop the setup, not skip the tests.
.venv/bin/python -c "import smg.rl" || { echo "setup: smg (the [smg] extra) did not install" >&2; exit 1; }
# Real framework client code for tests/frameworks (CI=true fails those tests without it):
# AReaL without its dependencies (they pull sglang, vllm and a CUDA torch; the light ones its
# control path imports are the [frameworks] extra), and verl's http_server_engine.py from its wheel.
.venv/bin/python -c "import areal" 2>/dev/null || .venv/bin/python -m pip install -q --no-deps areal==1.0.4
if [ ! -f "$VERL_SRC/verl/workers/rollout/sglang_rollout/http_server_engine.py" ]; then
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download -q --no-deps verl==0.9.1 -d "$tmp"
  mkdir -p "$VERL_SRC"
  .venv/bin/python -m zipfile -e "$tmp"/verl-0.9.1-py3-none-any.whl "$tmp/unpacked"
  mkdir -p "$VERL_SRC/verl/workers/rollout/sglang_rollout"
  cp "$tmp/unpacked/verl/workers/rollout/sglang_rollout/http_server_engine.py" "$VERL_SRC/verl/workers/rollout/sglang_rollout/"
  rm -rf "$tmp"
fi
# SkyRL's own vLLM client (resilience/testing/skyrl.py loads this one file): the wheel asks for Python >= 3.12, so it is
# fetched for 3.12 (the file itself runs on 3.11) and never installed (its imports pull ray, torch and vLLM).
if [ ! -f "$SKYRL_SRC/$SKYRL_FILE" ]; then
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: skyrl==0.4.0 -d "$tmp"
  .venv/bin/python -m zipfile -e "$tmp"/skyrl-0.4.0-py3-none-any.whl "$tmp/unpacked"
  mkdir -p "$SKYRL_SRC/$(dirname "$SKYRL_FILE")"
  cp "$tmp/unpacked/$SKYRL_FILE" "$SKYRL_SRC/$SKYRL_FILE"
  rm -rf "$tmp"
fi
echo "$WANT" > "$STAMP"
