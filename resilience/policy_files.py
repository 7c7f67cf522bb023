"""Loading policy tables from TOML and YAML.

Schema (TOML shown; YAML has the same shape)::

    [defaults]                      # optional: applied to every endpoint below
    deadline_s = 60

    [endpoints."POST /pause_generation"]
    idempotent = true
    attempt_timeout_s = 10
    retry = { max_attempts = 5, statuses = [502, 503, 504], base_s = 0.5 }

Unknown keys are rejected, and every error names the file, the field and
the rule it broke.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resilience.errors import PolicyError
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy

__all__ = ["load_policy_file", "table_from_dict"]

_RETRY_FIELDS = {f.name for f in dataclasses.fields(RetryPolicy)}
_ENDPOINT_FIELDS = {f.name for f in dataclasses.fields(EndpointPolicy)} - {"retry"}


def _check_keys(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise PolicyError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}")


def _retry_from(data: Any, where: str) -> RetryPolicy:
    if not isinstance(data, Mapping):
        raise PolicyError(f"{where}.retry must be a table/mapping, but was {data!r}")
    _check_keys(data, _RETRY_FIELDS, f"{where}.retry")
    kwargs = dict(data)
    if "statuses" in kwargs:
        statuses = kwargs["statuses"]
        if not isinstance(statuses, list):
            raise PolicyError(f"{where}.retry.statuses must be a list of integers, but was {statuses!r}")
        kwargs["statuses"] = frozenset(statuses)
    try:
        return RetryPolicy(**kwargs)
    except PolicyError as exc:
        raise PolicyError(f"{where}.retry: {exc}") from None
    except TypeError as exc:
        raise PolicyError(f"{where}.retry: {exc}") from None


def _endpoint_from(data: Any, defaults: Mapping[str, Any], where: str) -> EndpointPolicy:
    if not isinstance(data, Mapping):
        raise PolicyError(f"{where} must be a table/mapping, but was {data!r}")
    merged: dict[str, Any] = {**defaults, **data}
    if isinstance(defaults.get("retry"), Mapping) and isinstance(data.get("retry"), Mapping):
        merged["retry"] = {**defaults["retry"], **data["retry"]}
    _check_keys(merged, _ENDPOINT_FIELDS | {"retry"}, where)
    if merged.get("on_ambiguous", "raise") != "raise":
        raise PolicyError(
            f"{where}.on_ambiguous must be 'raise' in a file (probes are Python callables), but was {merged['on_ambiguous']!r}"
        )
    retry = _retry_from(merged.pop("retry"), where) if "retry" in merged else RetryPolicy()
    if "accept_statuses" in merged:
        merged["accept_statuses"] = frozenset(merged["accept_statuses"])
    try:
        return EndpointPolicy(retry=retry, **merged)
    except (PolicyError, TypeError) as exc:
        raise PolicyError(f"{where}: {exc}") from None


def table_from_dict(data: Mapping[str, Any], *, source: str = "policy") -> PolicyTable:
    """Build a ``PolicyTable`` from the parsed file schema; ``source`` prefixes error messages."""
    if not isinstance(data, Mapping):
        raise PolicyError(f"{source}: top level must be a table/mapping, but was {type(data).__name__}")
    _check_keys(data, {"defaults", "endpoints"}, source)
    defaults = data.get("defaults", {})
    if not isinstance(defaults, Mapping):
        raise PolicyError(f"{source}: defaults must be a table/mapping")
    _check_keys(defaults, _ENDPOINT_FIELDS | {"retry"}, f"{source}: defaults")
    endpoints = data.get("endpoints", {})
    if not isinstance(endpoints, Mapping):
        raise PolicyError(f"{source}: endpoints must be a table/mapping")
    entries = {key: _endpoint_from(value, defaults, f"{source}: endpoints[{key!r}]") for key, value in endpoints.items()}
    try:
        return PolicyTable(entries)
    except PolicyError as exc:
        raise PolicyError(f"{source}: {exc}") from None


def load_policy_file(path: str | Path) -> PolicyTable:
    """Load a TOML or YAML policy file into a ``PolicyTable``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{p}: cannot read policy file: {exc.strerror or exc}") from None
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
            if data is None:
                data = {}
        else:
            raise PolicyError(f"{p}: unknown policy file type {suffix!r}; use .toml, .yaml or .yml")
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{p}: invalid TOML: {exc}") from None
    except PolicyError:
        raise
    except Exception as exc:  # yaml.YAMLError and friends; yaml is imported lazily
        raise PolicyError(f"{p}: invalid YAML: {exc}") from None
    return table_from_dict(data, source=str(p))
