"""The emulator and ``SGLangClient`` against SGLang's own source: routes, methods, auth levels, fields, defaults.

Every comparison returns the list of differences, each one line naming the route or field and both sides; an empty
list means they agree. The inputs are plain values, so a test can feed a doctored side and see the check fail.
:func:`check` runs all of them on the wheel and refuses to compare sets that are empty or implausibly small.

What is compared, in both directions where both sides claim the route:

- the emulator's routes (but ``/_emulator/*``) exist in SGLang; for each, the methods are the same set, the auth level
  is the same, the query parameters the emulator takes exist in SGLang with the same defaults;
- the emulator's body model of each route has SGLang's body class's fields (but the internal ``http_worker_ipc``), the
  same required ones and the same defaults; ``/generate`` may model a subset;
- every ``(method, path)`` the client calls and every entry of ``SGLANG_POLICIES`` exists in SGLang and in the
  emulator; the client's admin routes are exactly the routes it calls that SGLang marks admin, and its open prefixes
  are SGLang's.
"""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from resilience.testing.emulator.routes import iter_routes
from tests.testing.sglang_source import FACTORY, REQUIRED, SglangSurface, SourceField, read_surface

__all__ = [
    "ContractReport", "EmulatorRoute", "check", "client_endpoints", "compare_bodies", "compare_client", "compare_routes",
    "emulator_routes",
]  # fmt: skip

INTERNAL_FIELDS = frozenset({"http_worker_ipc"})
"""SGLang request fields that only its own processes set (IPC routing)."""
SUBSET_BODIES = frozenset({"GenerateReqInput"})
"""Bodies the emulator may model in part (SGLang's ``/generate`` has ~70 fields; unknown keys are ignored)."""
MIN_SGLANG_ROUTES = 60
MIN_EMULATOR_ROUTES = 20
MIN_CLIENT_ENDPOINTS = 15


@dataclass(frozen=True, slots=True)
class EmulatorRoute:
    """One emulator route: its methods, auth level, body model and query defaults."""

    path: str
    methods: frozenset[str]
    auth: str
    body: type[BaseModel] | None = None
    query: Mapping[str, Any] = field(default_factory=dict)


def emulator_routes(app: Any) -> dict[str, EmulatorRoute]:
    """The emulator app's routes by path (``/_emulator/*`` left out), read through included routers."""
    found: dict[str, EmulatorRoute] = {}
    for info in iter_routes(app.routes):
        if info.path.startswith("/_emulator/"):
            continue
        body, query = _signature(info.endpoint)
        level = getattr(info.endpoint, "_auth_level", None)
        auth = str(getattr(level, "value", "normal"))
        old = found.get(info.path)
        methods = info.methods | (old.methods if old else frozenset())
        found[info.path] = EmulatorRoute(info.path, methods, auth, body, query)
    return found


def _signature(endpoint: Callable[..., Any] | None) -> tuple[type[BaseModel] | None, dict[str, Any]]:
    if endpoint is None:
        return None, {}
    hints = typing.get_type_hints(endpoint)
    body: type[BaseModel] | None = None
    query: dict[str, Any] = {}
    for name, param in inspect.signature(endpoint).parameters.items():
        hint = hints.get(name)
        models = [a for a in (typing.get_args(hint) or (hint,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if models:
            body = models[0]
        elif hint is not None and getattr(hint, "__name__", "") in ("Request", "Response"):
            continue
        else:
            default = param.default
            query[name] = REQUIRED if default is inspect.Parameter.empty else getattr(default, "default", default)
    return body, query


def compare_routes(sglang: SglangSurface, emulator: Mapping[str, EmulatorRoute]) -> list[str]:
    """Differences between the emulator's routes and SGLang's: existence, methods, auth level, query defaults."""
    problems: list[str] = []
    for path, ours in sorted(emulator.items()):
        theirs = sglang.routes.get(path)
        if theirs is None:
            problems.append(f"route {path}: the emulator serves it, SGLang {sglang.version} has no such route")
            continue
        if ours.methods != theirs.methods:
            problems.append(f"route {path}: methods {sorted(ours.methods)} in the emulator, {sorted(theirs.methods)} in SGLang")
        if ours.auth != theirs.auth:
            problems.append(f"route {path}: auth level {ours.auth} in the emulator, {theirs.auth} in SGLang")
        for name, default in sorted(ours.query.items()):
            if name not in theirs.query:
                problems.append(f"route {path}: query parameter {name!r} only in the emulator")
            elif theirs.query[name] != default:
                problems.append(f"route {path}: query {name!r} defaults to {default!r} in the emulator, {theirs.query[name]!r} in SGLang")
    return problems


def compare_bodies(sglang: SglangSurface, emulator: Mapping[str, EmulatorRoute]) -> list[str]:
    """Differences between each emulator route's body model and SGLang's body class for that route."""
    problems: list[str] = []
    for path, ours in sorted(emulator.items()):
        theirs = sglang.routes.get(path)
        if theirs is None or (ours.body is None and theirs.body is None):
            continue
        if ours.body is None or theirs.body is None:
            problems.append(f"route {path}: body {getattr(ours.body, '__name__', None)} in the emulator, {theirs.body} in SGLang")
            continue
        struct = sglang.structs.get(theirs.body)
        if not struct:
            problems.append(f"route {path}: SGLang's body class {theirs.body} was not found in io_struct.py")
            continue
        problems += _compare_fields(path, theirs.body, {n: f for n, f in struct.items() if n not in INTERNAL_FIELDS}, ours.body)
    return problems


def _compare_fields(path: str, cls: str, theirs: Mapping[str, SourceField], model: type[BaseModel]) -> list[str]:
    problems: list[str] = []
    ours = model.model_fields
    where = f"route {path} body {cls}"
    only_ours = sorted(set(ours) - set(theirs))
    only_theirs = sorted(set(theirs) - set(ours))
    if only_ours:
        problems.append(f"{where}: fields {only_ours} only in the emulator")
    if only_theirs and cls not in SUBSET_BODIES:
        problems.append(f"{where}: fields {only_theirs} only in SGLang")
    for name in sorted(set(ours) & set(theirs)):
        mine = REQUIRED if ours[name].is_required() else FACTORY if ours[name].default_factory is not None else ours[name].default
        other = theirs[name].default
        if (mine is REQUIRED) != (other is REQUIRED):
            problems.append(f"{where}: {name!r} is {'required' if mine is REQUIRED else 'optional'} in the emulator, not in SGLang")
        elif other is not FACTORY and mine is not FACTORY and mine != other:
            problems.append(f"{where}: {name!r} defaults to {mine!r} in the emulator, {other!r} in SGLang")
    return problems


def client_endpoints(*modules: Any) -> set[tuple[str, str]]:
    """Every ``(method, path)`` the SGLang clients call, read from their modules' source by AST.

    By default the sync and async clients and the pure functions both build their requests with
    (``adapters/sglang/client.py``, ``async_client.py``, ``calls.py``): a ``Call("METHOD", "/path", ...)``, and the
    helpers whose method is fixed (``memory_call`` POSTs, ``read_call`` and ``_health`` GET); and every route of the
    clients' method table (``adapters/sglang/routes.py``, ``METHODS``).
    """
    found: set[tuple[str, str]] = set()
    if not modules:
        from resilience.adapters.sglang import async_client, calls, client
        from resilience.adapters.sglang.routes import METHODS

        modules = (client, async_client, calls)
        found.update((m.http, m.path) for m in METHODS)
    fixed = {"memory_call": "POST", "read_call": "GET", "_health": "GET", "_control": "POST", "_weights": "POST"}
    for module in modules:
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id if isinstance(node.func, ast.Name) else ""
            consts = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if name in ("Call", "_request") and len(consts) >= 2 and consts[1].startswith("/"):
                found.add((consts[0], consts[1]))
            elif name in fixed and consts and consts[0].startswith("/"):
                found.add((fixed[name], consts[0]))
    return found


def compare_client(
    sglang: SglangSurface,
    emulator: Mapping[str, EmulatorRoute],
    calls: Iterable[tuple[str, str]],
    policy_keys: Iterable[str],
    admin_paths: Iterable[str],
    open_prefixes: Iterable[str],
) -> list[str]:
    """Differences between what the client calls (and its policy table and key rules) and both servers."""
    problems: list[str] = []
    theirs = sglang.method_paths()
    ours = {(m, r.path) for r in emulator.values() for m in r.methods}
    calls = set(calls)
    for method, path in sorted(calls):
        if (method, path) not in theirs:
            problems.append(f"client calls {method} {path}: SGLang {sglang.version} has no such route")
        if (method, path) not in ours:
            problems.append(f"client calls {method} {path}: the emulator does not serve it")
    for key in sorted(policy_keys):
        methods, _, path = key.partition(" ")
        for method in methods.split("|"):
            if (method, path) not in theirs:
                problems.append(f"SGLANG_POLICIES entry {key!r}: SGLang has no {method} {path}")
    admin = set(admin_paths)
    used = {path for _, path in calls}
    should = {p for p in used if sglang.routes.get(p) is not None and sglang.routes[p].auth != "normal"}
    for path in sorted(should - admin):
        problems.append(f"client sends the API key to {path}, which SGLang marks {sglang.routes[path].auth}")
    for path in sorted(admin - {p for p, r in sglang.routes.items() if r.auth != "normal"}):
        problems.append(f"client sends the admin key to {path}, which SGLang does not mark admin")
    if tuple(open_prefixes) != sglang.open_prefixes:
        problems.append(f"client's open prefixes {tuple(open_prefixes)} differ from SGLang's {sglang.open_prefixes}")
    return problems


@dataclass(frozen=True, slots=True)
class ContractReport:
    """What a contract check compared (sizes) and every difference it found: this module's :func:`check` for SGLang,
    ``vllm_contract.py``'s for vLLM."""

    engine_version: str
    """The version of the engine's wheel read (``0.5.23``, ``0.33.0``)."""
    sizes: Mapping[str, int]
    problems: tuple[str, ...]


def check(wheel: Any, app: Any = None) -> ContractReport:
    """Read the wheel, build an emulator app, and run every comparison.

    Raises AssertionError when a compared set is empty or implausibly small: a check
    over nothing would pass whatever the emulator did.
    """
    from resilience.adapters.sglang import SGLANG_ADMIN_PATHS, SGLANG_OPEN_PREFIXES, SGLANG_POLICIES

    sglang = read_surface(wheel)
    if app is None:
        from resilience.testing.emulator.app import create_app
        from resilience.testing.emulator.config import EngineConfig

        app = create_app(EngineConfig())[0]
    emulator = emulator_routes(app)
    calls = client_endpoints()
    policy_keys = list(SGLANG_POLICIES.entries)
    sizes = {
        "sglang_routes": len(sglang.routes),
        "sglang_structs": len(sglang.structs),
        "emulator_routes": len(emulator),
        "emulator_bodies": sum(1 for r in emulator.values() if r.body is not None),
        "client_endpoints": len(calls),
        "policy_entries": len(policy_keys),
        "admin_paths": len(SGLANG_ADMIN_PATHS),
    }
    minimum = {"sglang_routes": MIN_SGLANG_ROUTES, "emulator_routes": MIN_EMULATOR_ROUTES, "client_endpoints": MIN_CLIENT_ENDPOINTS}
    for name, size in sizes.items():
        assert size >= minimum.get(name, 5), f"contract: {name} has {size} entries, fewer than a real surface has"
    problems = (
        compare_routes(sglang, emulator)
        + compare_bodies(sglang, emulator)
        + compare_client(sglang, emulator, calls, policy_keys, SGLANG_ADMIN_PATHS, SGLANG_OPEN_PREFIXES)
    )
    return ContractReport(sglang.version, sizes, tuple(problems))
