"""Helpers for the ``cpr`` tests: run the real command in a subprocess, read its tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CPR = [sys.executable, "-m", "resilience.cli"]
"""The ``cpr`` command, as the installed console script runs it."""


def run_cpr(*args: str, cwd: Path, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    """Run ``cpr ARGS`` in ``cwd`` and wait (a hung command is killed after ``timeout`` s and fails the test)."""
    return subprocess.run([*CPR, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the rich tables in ``text``: the cells between the ``│`` separators, stripped."""
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]


def error_lines(stderr: str) -> list[str]:
    """The non-empty lines of stderr."""
    return [line for line in stderr.splitlines() if line.strip()]
