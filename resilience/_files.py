"""Reading TOML, YAML and JSON files into plain data: one loader for policy files and fault plans.

The format is chosen by the file's suffix (pyyaml is imported only for YAML); every error names the file.
"""

from __future__ import annotations

import importlib
import json
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from resilience.errors import ConfigError

__all__ = ["read_data_file"]

_FORMATS = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}


def _names(suffixes: tuple[str, ...]) -> str:
    return suffixes[0] if len(suffixes) == 1 else f"{', '.join(suffixes[:-1])} or {suffixes[-1]}"


def read_data_file(
    path: str | Path,
    *,
    what: str,
    suffixes: Iterable[str] = (".toml", ".yaml", ".yml"),
    error: type[ConfigError] = ConfigError,
) -> Any:
    """The parsed content of ``path`` (an empty YAML file reads as ``{}``).

    ``what`` names the kind of file in messages ("policy file", "plan"); ``suffixes`` are the formats accepted (from
    ``.toml``, ``.yaml``, ``.yml``, ``.json``); ``error`` is the ``ConfigError`` subclass raised.
    """
    p = Path(path)
    allowed = tuple(suffixes)
    suffix = p.suffix.lower()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{p}: cannot read {what}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{p}: not a text {what} (byte {exc.start} is not UTF-8); expected {_names(allowed)} text") from None
    if suffix not in allowed or suffix not in _FORMATS:
        raise error(f"{p}: unknown {what} type {suffix!r}; use {_names(allowed)}")
    fmt = _FORMATS[suffix]
    if fmt == "YAML":
        try:
            yaml = importlib.import_module("yaml")
        except ImportError:
            raise error(f"{p}: reading YAML needs pyyaml (pip install pyyaml)") from None
    try:
        if fmt == "TOML":
            return tomllib.loads(text)
        if fmt == "JSON":
            return json.loads(text)
        data = yaml.safe_load(text)
        return {} if data is None else data
    except Exception as exc:  # each parser has its own error type (TOMLDecodeError, YAMLError, JSONDecodeError)
        raise error(f"{p}: invalid {fmt}: {exc}") from None
