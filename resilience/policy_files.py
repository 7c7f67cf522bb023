"""Loading policy tables from TOML and YAML (the schema, every key shown: ``docs/policy-files.md``).

Unknown keys are rejected; booleans must be true/false (not "false" or "no"),
numbers numbers; every error names the file, the field and the rule it broke.

Over a base table (``cpr policies --over-sglang``, ``load_policy_file(path,
base=...)``), an entry whose template and methods match a base entry
overrides it: it starts from the base policy and changes only the fields the
entry names (``[defaults]`` do not apply to it). Methods the file does not
name keep the base policy, under their own key.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from resilience._files import read_data_file
from resilience.errors import ConfigError
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy, parse_key, template_shape

__all__ = ["load_policy_file", "table_from_dict"]

_RETRY_FIELDS = {f.name for f in dataclasses.fields(RetryPolicy)}
_ENDPOINT_FIELDS = {f.name for f in dataclasses.fields(EndpointPolicy)}
_Policy = TypeVar("_Policy", RetryPolicy, EndpointPolicy)


def _table(value: Any, allowed: set[str] | None, where: str) -> Mapping[str, Any]:
    """``value``, a mapping whose keys are all in ``allowed`` (None: any); else ConfigError naming ``where``."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a table/mapping, but was {reprlib.repr(value)}")
    if allowed is not None and not set(value) <= allowed:
        unknown = ", ".join(map(repr, sorted(set(value) - allowed)))
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {', '.join(sorted(allowed))}")
    return value


def _replace(policy: _Policy, data: Mapping[str, Any], where: str) -> _Policy:
    """``policy`` with the fields ``data`` names (unnamed ones keep their value, an ``UnnamedSeconds`` too)."""
    try:
        return dataclasses.replace(policy, **data)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _endpoint_from(data: Any, defaults: Mapping[str, Any], where: str, start: EndpointPolicy | None = None) -> EndpointPolicy:
    """An entry's policy: ``start`` (a base entry it overrides) or the defaults, then the fields it names."""
    data = _table(data, _ENDPOINT_FIELDS, where)
    merged: dict[str, Any] = dict(data) if start is not None else {**defaults, **data}
    if start is None and isinstance(defaults.get("retry"), Mapping) and isinstance(data.get("retry"), Mapping):
        merged["retry"] = {**defaults["retry"], **data["retry"]}
    if merged.get("on_ambiguous", "raise") != "raise":
        raise ConfigError(
            f"{where}.on_ambiguous must be 'raise' in a file (probes are Python callables), but was {merged['on_ambiguous']!r}"
        )
    base = start or EndpointPolicy()
    if "retry" in merged:
        merged["retry"] = _replace(base.retry, _table(merged["retry"], _RETRY_FIELDS, f"{where}.retry"), f"{where}.retry")
    return _replace(base, merged, where)


def _key(methods: frozenset[str] | None, template: str) -> str:
    return f"{'|'.join(sorted(methods)) if methods is not None else '*'} {template}"


def _overlay(base: PolicyTable, endpoints: Mapping[str, Any], defaults: Mapping[str, Any], source: str) -> dict[str, EndpointPolicy]:
    """The base entries with the file's entries overriding the ones they match (same template, shared methods)."""
    entries = list(base.entries.items())
    for key, raw in endpoints.items():
        where = f"{source}: endpoints[{key!r}]"
        methods, template = parse_key(key)  # an error here gets its "{source}: " from table_from_dict
        covered: set[str] = set()
        replaced: list[tuple[str, EndpointPolicy]] = []
        for base_key, policy in entries:
            base_methods, base_template = parse_key(base_key)
            common = base_methods if methods is None else methods if base_methods is None else base_methods & methods  # None: all
            if template_shape(base_template) != template_shape(template) or common == frozenset():
                replaced.append((base_key, policy))
                continue
            replaced.append((_key(common, base_template), _endpoint_from(raw, defaults, where, start=policy)))
            if common is not None and common != base_methods:  # the base entry keeps the methods the file does not name
                replaced.append((base_key if base_methods is None else _key(base_methods - common, base_template), policy))
            covered |= common if common is not None else {"*"}
        entries = replaced
        rest = None if methods is None else methods - covered
        if "*" not in covered and (rest is None or rest):
            entries.append((_key(rest, template), _endpoint_from(raw, defaults, where)))
    return dict(entries)


def table_from_dict(data: Mapping[str, Any], *, source: str = "policy", base: PolicyTable | None = None) -> PolicyTable:
    """Build a ``PolicyTable`` from the parsed file schema, over ``base`` if given; ``source`` prefixes error messages."""
    data = _table(data, {"defaults", "endpoints"}, source)
    defaults = _table(data.get("defaults", {}), _ENDPOINT_FIELDS, f"{source}: defaults")
    endpoints = _table(data.get("endpoints", {}), None, f"{source}: endpoints")
    if defaults and not endpoints:
        raise ConfigError(
            f"{source}: [defaults] apply only to the endpoints the file lists under [endpoints], and it lists none, "
            "so they would apply to nothing (requests no entry matches get EndpointPolicy.for_method); add endpoints"
        )
    if defaults:  # validate the defaults themselves, so an error names them rather than the first endpoint
        _endpoint_from({}, defaults, f"{source}: defaults")
    try:
        if base is not None:
            return PolicyTable(_overlay(base, endpoints, defaults, source))
        entries = {key: _endpoint_from(value, defaults, f"{source}: endpoints[{key!r}]") for key, value in endpoints.items()}
        return PolicyTable(entries)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(f"{source}:") else f"{source}: {message}") from None


def load_policy_file(path: str | Path, *, base: PolicyTable | None = None) -> PolicyTable:
    """Load a TOML (``.toml``) or YAML (``.yaml``/``.yml``) policy file into a ``PolicyTable``, over ``base`` if given."""
    data = read_data_file(path, what="policy file", error=ConfigError)
    return table_from_dict(data, source=str(Path(path)), base=base)
