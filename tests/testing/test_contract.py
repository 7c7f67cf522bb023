"""Contract, import-based: the emulator and SGLangClient against the *running* sglang FastAPI app and io_struct.

Opt-in: skipped unless sglang imports (``CPR_REQUIRE_SGLANG=1`` makes that a failure).
``scripts/contract.sh`` builds a venv outside the repository with the pinned wheel and
runs this module. The default run has the AST check (``test_contract_wheel.py``), which
needs no GPU stack; this one also sees what the source cannot show (routes added at
import time, the classes FastAPI really binds).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import typing
from typing import Any

import pytest

from resilience.adapters.sglang import SGLANG_ADMIN_PATHS, SGLANG_POLICIES
from resilience.testing.emulator import EngineConfig
from resilience.testing.emulator.routes import iter_routes
from tests.testing.sglang_contract import INTERNAL_FIELDS, SUBSET_BODIES, client_endpoints, emulator_routes

try:
    http_server = importlib.import_module("sglang.srt.entrypoints.http_server")
except Exception as exc:  # sglang pulls in much; any import failure means "not here"
    if os.environ.get("CPR_REQUIRE_SGLANG") == "1":
        raise
    pytest.skip(f"sglang is not importable here ({type(exc).__name__}: {exc})", allow_module_level=True)


def live_routes() -> dict[str, tuple[frozenset[str], str, Any]]:
    """SGLang's routes by path: methods, auth level, endpoint."""
    found: dict[str, tuple[frozenset[str], str, Any]] = {}
    for info in iter_routes(http_server.app.routes):
        level = getattr(info.endpoint, "_auth_level", None)
        old = found.get(info.path)
        methods = info.methods | (old[0] if old else frozenset())
        found[info.path] = (methods, str(getattr(level, "value", "normal")), info.endpoint)
    return found


def fields_with_defaults(cls: Any) -> dict[str, Any]:
    """Field -> default (``...`` when required) of a dataclass or a msgspec Struct."""
    if dataclasses.is_dataclass(cls):
        found: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            has_factory = f.default_factory is not dataclasses.MISSING
            found[f.name] = f.default if f.default is not dataclasses.MISSING else "factory" if has_factory else ...
        return found
    # msgspec's own account of each field: a ``kw_only`` Struct (io_struct's since 0.5.x) may put a required field after
    # defaulted ones, so ``__struct_defaults__`` padded from the left would misplace the defaults
    structs = importlib.import_module("msgspec.structs")  # sglang's dependency: here whenever sglang imports
    return {
        f.name: ... if f.required else "factory" if f.default_factory is not structs.NODEFAULT else f.default
        for f in structs.fields(cls)
    }


def body_class(endpoint: Any) -> Any:
    hints = typing.get_type_hints(endpoint, include_extras=False)
    for name, hint in hints.items():
        if name != "return" and (dataclasses.is_dataclass(hint) or hasattr(hint, "__struct_fields__")):
            return hint
    return None


def test_routes_both_ways_for_what_client_and_emulator_use() -> None:
    """Client calls exist in SGLang and the emulator; emulator routes match SGLang's methods and auth levels."""
    from resilience.testing.emulator.app import create_app

    theirs = live_routes()
    ours = emulator_routes(create_app(EngineConfig())[0])
    calls = client_endpoints()
    assert len(theirs) >= 60 and len(ours) >= 20 and len(calls) >= 15
    problems = []
    for method, path in sorted(calls):
        if path not in theirs or method not in theirs[path][0]:
            problems.append(f"client {method} {path}: not in sglang")
        if path not in ours or method not in ours[path].methods:
            problems.append(f"client {method} {path}: not in the emulator")
    for key in SGLANG_POLICIES.entries:
        methods, _, path = key.partition(" ")
        missing = [m for m in methods.split("|") if path not in theirs or m not in theirs[path][0]]
        problems += [f"policy {key}: sglang has no {m} {path}" for m in missing]
    for path, route in sorted(ours.items()):
        if path not in theirs:
            problems.append(f"emulator {path}: not in sglang")
            continue
        methods, level, _ = theirs[path]
        if route.methods != methods or route.auth != level:
            problems.append(f"emulator {path}: {sorted(route.methods)}/{route.auth} vs sglang {sorted(methods)}/{level}")
    admin_used = {p for _, p in calls if p in theirs and theirs[p][1] != "normal"}
    if admin_used != {p for p in SGLANG_ADMIN_PATHS if p in {c[1] for c in calls}}:
        problems.append(f"client admin paths differ: sglang marks {sorted(admin_used)}")
    assert not problems, "\n".join(problems)


def test_body_fields_and_defaults_both_ways() -> None:
    """Each emulator body has the fields, required fields and defaults of the class sglang binds on that route."""
    from resilience.testing.emulator.app import create_app

    theirs = live_routes()
    ours = emulator_routes(create_app(EngineConfig())[0])
    compared = 0
    problems = []
    for path, route in sorted(ours.items()):
        if route.body is None or path not in theirs:
            continue
        cls = body_class(theirs[path][2])
        assert cls is not None, f"sglang binds no body class on {path}"
        compared += 1
        sg = {n: d for n, d in fields_with_defaults(cls).items() if n not in INTERNAL_FIELDS}
        em = route.body.model_fields
        if set(em) - set(sg):
            problems.append(f"{path}: only in the emulator {sorted(set(em) - set(sg))}")
        if set(sg) - set(em) and cls.__name__ not in SUBSET_BODIES:
            problems.append(f"{path}: only in sglang {sorted(set(sg) - set(em))}")
        for name in set(em) & set(sg):
            required = em[name].is_required()
            if required != (sg[name] is ...):
                problems.append(f"{path}.{name}: required {required} in the emulator")
            elif not required and sg[name] != "factory" and em[name].default != sg[name]:
                problems.append(f"{path}.{name}: default {em[name].default!r} vs sglang {sg[name]!r}")
    assert compared >= 12
    assert not problems, "\n".join(problems)
