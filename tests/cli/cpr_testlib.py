"""Helpers for the ``cpr`` tests: run the real command in a subprocess, read its tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["CPR", "error_lines", "run_cpr", "table_rows"]

CPR = [sys.executable, "-m", "resilience.cli"]
"""The ``cpr`` command, as the installed console script runs it."""


def run_cpr(*args: str, cwd: Path, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    """Run ``cpr ARGS`` in ``cwd`` and wait (a hung command is killed after ``timeout`` s and fails the test)."""
    return subprocess.run([*CPR, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the rich tables in ``text``: the cells between the ``│`` separators, stripped.

    A line whose first cell is empty continues the row above (a wrapped cell); it is joined to it.
    """
    rows: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if rows and not cells[0] and len(cells) == len(rows[-1]):
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
        else:
            rows.append(cells)
    return rows


def error_lines(stderr: str) -> list[str]:
    """The non-empty lines of stderr."""
    return [line for line in stderr.splitlines() if line.strip()]
