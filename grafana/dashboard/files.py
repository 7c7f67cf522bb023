"""Writing and checking the committed outputs, and the command line (``python -m grafana.dashboard``)."""

import argparse
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path

from grafana.dashboard.build import dashboard_json
from grafana.dashboard.rules import rules_yaml

__all__ = ["DASHBOARD_FILENAME", "DEFAULT_DASHBOARD_DIR", "DEFAULT_RULES_DIR", "RULES_FILENAME", "generate", "generate_rules", "main"]

GRAFANA_DIR = Path(__file__).resolve().parent.parent
"""The repository's ``grafana/`` folder (this package's parent)."""
DEFAULT_DASHBOARD_DIR = GRAFANA_DIR / "dashboards"
"""Where ``generate()`` writes the dashboard by default (the committed copy)."""
DEFAULT_RULES_DIR = GRAFANA_DIR / "rules"
"""Where ``generate_rules()`` writes the alert rules by default (the committed copy)."""
DASHBOARD_FILENAME = "controlplane-resilience.json"
RULES_FILENAME = "controlplane-resilience.rules.yml"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8", newline="\n")
    return path


def generate(out_dir: Path | str = DEFAULT_DASHBOARD_DIR) -> list[Path]:
    """Write the dashboard JSON into ``out_dir``; return the paths written."""
    return [_write(Path(out_dir) / DASHBOARD_FILENAME, dashboard_json())]


def generate_rules(out_dir: Path | str = DEFAULT_RULES_DIR) -> list[Path]:
    """Write the Prometheus alert rules into ``out_dir``; return the paths written."""
    return [_write(Path(out_dir) / RULES_FILENAME, rules_yaml())]


def _check(path: Path, expected: str) -> bool:
    actual = path.read_text(encoding="utf-8") if path.exists() else ""
    if actual == expected:
        return True
    diff = difflib.unified_diff(actual.splitlines(keepends=True), expected.splitlines(keepends=True), str(path), "generated", n=2)
    sys.stderr.write(f"{path} is stale; run: python -m grafana.dashboard\n")
    sys.stderr.writelines(list(diff)[:60])
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write (default) or ``--check`` the dashboard and rules; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m grafana.dashboard",
        description="Generate (or --check) the controlplane-resilience Grafana dashboard and Prometheus alert rules.",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_DASHBOARD_DIR, help="dashboard folder (%(default)s)")
    parser.add_argument("--rules-out", type=Path, default=DEFAULT_RULES_DIR, help="rules folder (%(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file there differs from a fresh generation")
    args = parser.parse_args(argv)
    outputs = ((args.out / DASHBOARD_FILENAME, dashboard_json()), (args.rules_out / RULES_FILENAME, rules_yaml()))
    if args.check:
        ok = [_check(path, text) for path, text in outputs]
        return 0 if all(ok) else 1
    for path, text in outputs:
        print(_write(path, text))
    return 0
