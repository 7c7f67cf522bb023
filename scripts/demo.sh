#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: `cpr demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/cpr demo "$@"
