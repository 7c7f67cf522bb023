#!/usr/bin/env bash
# Set up (scripts/setup.sh), then lint, type-check, build the docs strictly and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
# The docs site (mkdocs.yml): a broken link, a missing page or a docstring reference that does not
# resolve fails the build. Built into a temporary folder (never committed), offline, in seconds.
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
.venv/bin/python -m pytest "$@"
