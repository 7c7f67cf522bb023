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
# The suite on CPR_TEST_WORKERS pytest-xdist workers (default 2: most tests wait on engines, sockets and
# subprocesses, so two workers overlap those waits even on 2 cores). tests/conftest.py schedules it safely
# (each module whole on one worker, the Ray modules as one unit, tests/frameworks last). CPR_TEST_WORKERS=0
# runs it in this one process. Arguments go on to pytest (after -n, so a later -n wins).
.venv/bin/python -m pytest -n "${CPR_TEST_WORKERS:-2}" "$@"
