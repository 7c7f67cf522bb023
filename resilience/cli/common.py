"""What every ``cpr`` subcommand shares: one-line errors, argument types, output checks, optional imports.

A subcommand raises :class:`CliError`; ``main`` prints it as one line on stderr and exits with its ``code``
(2 for argument errors, like argparse's own).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

__all__ = [
    "ROUTERS",
    "CliError",
    "add_router",
    "OneLineParser",
    "check_output_file",
    "need",
    "plural",
    "port_number",
    "positive_float",
    "positive_int",
    "write_json",
]


ROUTERS = ("direct", "smg")
"""What ``--router`` takes (``cpr demo``, ``cpr probe``, ``cpr emulate``): the engines straight, or behind a real smg gateway."""


def add_router(parser: argparse.ArgumentParser, smg: str) -> None:
    """Add ``--router direct|smg`` (default direct) to ``parser``; ``smg``: what ``smg`` means for this subcommand."""
    parser.add_argument("--router", choices=ROUTERS, default="direct", help=f"smg: {smg}; default direct (no gateway)")


class CliError(Exception):
    """A user-facing failure: ``cpr`` prints ``message`` as one line on stderr and exits with ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = " ".join(message.split())
        """The line printed (whitespace folded, so it stays one line)."""
        self.code = code
        """The exit status: 2 for bad arguments, 1 for everything else."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: error: ... (see prog --help)``), exit 2; abbreviated long
    flags refused unless asked (``cpr demo --engine 2`` must not quietly run as ``--engines 2``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print one line on stderr and exit 2 (argparse prints the usage too; that is noise here)."""
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _int_in(text: str, low: int, high: int | None, rule: str) -> int:
    """Parse ``text`` as an integer in ``low..high`` (``high`` None: no upper end), or fail saying ``must be {rule}``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {rule}, but was {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {rule}, but was {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_in(text, 1, None, "an integer >= 1")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_in(text, 0, None, "an integer >= 0")


def port_number(text: str) -> int:
    """argparse type: a TCP port 0..65535 (0 = pick a free one)."""
    return _int_in(text, 0, 65535, "a port number 0..65535")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, but was {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, but was {text}")
    return value


def check_output_file(path: Path, what: str, suffixes: tuple[str, ...] = ()) -> Path:
    """Fail now, before any work, when ``path`` cannot be written (or has a suffix not in ``suffixes``)."""
    if suffixes and path.suffix.lower() not in suffixes:
        raise CliError(f"{what} {str(path)!r} must end in {' or '.join(suffixes)}, but ends in {path.suffix or 'nothing'!r}", 2)
    if path.is_dir():
        raise CliError(f"{what} {str(path)!r} is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise CliError(f"{what} {str(path)!r}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CliError(f"{what} {str(path)!r} is not writable")
    return path


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON (sorted keys, one trailing newline); an OSError becomes a CliError."""
    try:
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 engine``, ``3 engines``, ``0 engines`` (``many`` for irregular plurals: ``plural(n, "entry", "entries")``)."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def need(module: str, extra: str, why: str) -> ModuleType:
    """Import an optional dependency, or fail with the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CliError(f"{why} needs {module.split('.')[0]}: pip install 'controlplane-resilience[{extra}]'") from None
