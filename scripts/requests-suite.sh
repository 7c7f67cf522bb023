#!/usr/bin/env bash
# Opt-in compatibility proof: run psf/requests' own test suite for the installed requests version twice,
# plain and with every Session mounting ResilientAdapter (scripts/requests_suite_plugin.py), inside a
# network namespace where only loopback is up (the suite dials non-loopback addresses). Then compare:
# no test may fail only with the adapter.
#
#   bash scripts/requests-suite.sh            # prints both summaries and the comparison; exit 1 on a regression
#
# Each test gets at most CPR_SUITE_TEST_TIMEOUT seconds (default 90; pytest-timeout): a test that waits forever
# with the adapter (a retried connection to a one-shot fake server that then never answers) fails instead of hanging.
# Needs: network access to PyPI the first time (sdist + test deps), `unshare` (user namespaces) and `ip`.
# Everything it downloads or builds lives outside the repository, under ${CPR_CACHE:-~/.cache/cpr}.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${CPR_CACHE:-$HOME/.cache/cpr}"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
VERSION="$("$PY" -c 'import requests; print(requests.__version__)')"
URLLIB3="$("$PY" -c 'import urllib3; print(urllib3.__version__)')"
SRC="$CACHE/requests-$VERSION"
VENV="$CACHE/requests-suite-venv"
OUT="$CACHE/requests-suite-results"
mkdir -p "$CACHE" "$OUT"

if [ ! -d "$SRC/tests" ]; then
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "requests==$VERSION" -d "$CACHE/sdist"
    tar -xzf "$CACHE/sdist/requests-$VERSION.tar.gz" -C "$CACHE"
fi
if ! "$VENV/bin/python" -c "import pytest_timeout, requests, sys; sys.exit(requests.__version__ != '$VERSION')" 2>/dev/null; then
    "$PY" -m venv "$VENV"
    # The suite's own test deps (requests' pyproject [test] + requirements-dev.txt), and this project's core deps.
    "$VENV/bin/pip" install --quiet "requests[socks]==$VERSION" "urllib3==$URLLIB3" pyyaml \
        "pytest>=8,<9" "pytest-httpbin==2.1.0" "httpbin~=0.10.0" trustme pytest-mock pytest-timeout
fi

run_suite() {  # $1 = label, $2 = extra pytest args
    local label="$1" extra="$2"
    unshare --net --map-root-user bash -c "
        ip link set lo up
        cd '$SRC'
        PYTHONPATH='$REPO:$REPO/scripts' '$VENV/bin/python' -m pytest tests -q -p no:cacheprovider -o addopts='' \
            --timeout="${CPR_SUITE_TEST_TIMEOUT:-90}" --junitxml='$OUT/$label.xml' $extra
    " >"$OUT/$label.log" 2>&1 || true
    echo "== $label: $(grep -E '^(=+ )?[0-9]+ (passed|failed)|[0-9]+ passed' "$OUT/$label.log" | tail -1)"
}

echo "requests $VERSION (urllib3 $URLLIB3), suite from $SRC, logs in $OUT"
run_suite plain ""
run_suite adapter "-p requests_suite_plugin"

"$VENV/bin/python" - "$OUT/plain.xml" "$OUT/adapter.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

def outcomes(path):
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        result[name] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return result

plain, adapter = outcomes(sys.argv[1]), outcomes(sys.argv[2])
assert len(plain) > 100 and len(adapter) > 100, (len(plain), len(adapter))
for label, res in (("plain", plain), ("adapter", adapter)):
    counts = {k: sum(1 for v in res.values() if v == k) for k in ("passed", "failed", "skipped")}
    print(f"{label:8s} {len(res)} tests: {counts}")
only = sorted(n for n, v in adapter.items() if v == "failed" and plain.get(n) != "failed")
print(f"failing only with the adapter: {len(only)}")
for name in only:
    print("  " + name)
sys.exit(1 if only else 0)
PY
