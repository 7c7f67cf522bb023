"""SGLang's HTTP surface read from its wheel's source, by AST: nothing of sglang is imported or run.

From a wheel (a zip; :func:`~.engine_wheel.find_wheel` finds it) this reads ``sglang/srt/entrypoints/http_server.py``
and the routers it includes (``entrypoints/v1_loads.py``) for routes, methods, auth levels, body classes and query
parameters with their defaults; ``sglang/srt/managers/io_struct.py`` for the request classes' fields, which are
required and their defaults; and ``sglang/srt/utils/auth.py`` for the paths that need no key.
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.testing.engine_wheel import WheelUnavailable, wheel_version

__all__ = ["FACTORY", "REQUIRED", "SglangSurface", "SourceField", "SourceRoute", "read_surface"]

_HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
_INCLUDED_ROUTERS = {"v1_loads_router": "sglang/srt/entrypoints/v1_loads.py", "elastic_ep_router": "sglang/srt/entrypoints/elastic_ep.py"}
_IO_STRUCT = "sglang/srt/managers/io_struct.py"
_AUTH = "sglang/srt/utils/auth.py"
_VERBS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "patch": "PATCH"}


class _Marker:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


REQUIRED: Any = _Marker("REQUIRED")
"""Default of a field or parameter that has none."""
FACTORY: Any = _Marker("FACTORY")
"""Default of a field built by ``default_factory`` (compared by presence only)."""


@dataclass(frozen=True, slots=True)
class SourceField:
    """One field of a request class: whether it is required and its default (a literal, or its source text)."""

    name: str
    default: Any


@dataclass(frozen=True, slots=True)
class SourceRoute:
    """One route of SGLang's HTTP server as its source declares it."""

    path: str
    methods: frozenset[str]
    auth: str
    """``normal``, ``admin_optional`` or ``admin_force`` (SGLang's ``AuthLevel`` values)."""
    body: str | None
    """The request class of the body (an ``io_struct`` name), or None."""
    query: Mapping[str, Any] = field(default_factory=dict)
    """Query parameters and their defaults."""


@dataclass(frozen=True, slots=True)
class SglangSurface:
    """What the wheel's source says about SGLang's HTTP surface."""

    version: str
    routes: Mapping[str, SourceRoute]
    """By path."""
    structs: Mapping[str, Mapping[str, SourceField]]
    """Request class name -> field name -> field (inherited fields included)."""
    open_prefixes: tuple[str, ...]
    """Path prefixes that never need a key (``utils/auth.py``)."""
    unresolved_paths: int = 0
    """Route decorators whose path is not a literal (counted, not guessed)."""

    def method_paths(self) -> set[tuple[str, str]]:
        """Every ``(method, path)`` pair."""
        return {(m, r.path) for r in self.routes.values() for m in r.methods}


# ----- reading the source ---------------------------------------------------------------------


def read_surface(wheel: Path) -> SglangSurface:
    """Parse the wheel's HTTP server, included routers, io_struct and auth modules."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())

        def source(path: str) -> ast.Module:
            if path not in names:
                raise WheelUnavailable(f"{wheel.name} has no {path}")
            return ast.parse(zf.read(path).decode("utf-8"), filename=path)

        server = source(_HTTP_SERVER)
        routes: dict[str, SourceRoute] = {}
        unresolved = _collect_routes(server, "app", routes)
        for router, module in _INCLUDED_ROUTERS.items():
            if module in names and _includes(server, router):
                unresolved += _collect_routes(source(module), "router", routes)
        structs = _structs(source(_IO_STRUCT))
        open_prefixes = _open_prefixes(source(_AUTH))
        version = wheel_version(zf)
    return SglangSurface(version, routes, structs, open_prefixes, unresolved)


def _includes(module: ast.Module, router: str) -> bool:
    for node in ast.walk(module):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "include_router":
            if any(isinstance(a, ast.Name) and a.id == router for a in node.args):
                return True
    return False


def _functions(module: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(module):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _literal_path(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    # os.environ.get("SGLANG_..._ROUTE", "/api/chat"): the default is the route
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and len(node.args) == 2:
        return _literal_path(node.args[1])
    return None


def _collect_routes(module: ast.Module, owner: str, into: dict[str, SourceRoute]) -> int:
    unresolved = 0
    for fn in _functions(module):
        level = "normal"
        found: list[tuple[str, frozenset[str]]] = []
        for deco in fn.decorator_list:
            if not isinstance(deco, ast.Call):
                continue
            func = deco.func
            if isinstance(func, ast.Name) and func.id == "auth_level" and deco.args and isinstance(deco.args[0], ast.Attribute):
                level = deco.args[0].attr.lower()
                continue
            if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == owner):
                continue
            if func.attr not in (*_VERBS, "api_route"):
                continue  # websocket, head, exception_handler, middleware
            path = _literal_path(deco.args[0]) if deco.args else None
            if path is None:
                unresolved += 1
                continue
            if func.attr == "api_route":
                methods = frozenset({"GET"})
                for kw in deco.keywords:
                    if kw.arg == "methods" and isinstance(kw.value, ast.List | ast.Tuple):
                        methods = frozenset(str(e.value) for e in kw.value.elts if isinstance(e, ast.Constant))
            else:
                methods = frozenset({_VERBS[func.attr]})
            found.append((path, methods))
        body, query = _parameters(fn)
        for path, methods in found:
            old = into.get(path)
            merged = methods | (old.methods if old else frozenset())
            into[path] = SourceRoute(path, merged, level if old is None or old.auth == "normal" else old.auth, body, query)
    return unresolved


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str | None, dict[str, Any]]:
    """The body class (first parameter typed with a class name) and the query parameters with defaults."""
    args = fn.args.args
    defaults: list[ast.expr | None] = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
    body: str | None = None
    query: dict[str, Any] = {}
    for arg, default in zip(args, defaults, strict=True):
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated":
            inner = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
            ann = inner
        name = ann.id if isinstance(ann, ast.Name) else None
        if isinstance(default, ast.Call) and isinstance(default.func, ast.Name) and default.func.id == "Query":
            query[arg.arg] = _literal(default.args[0]) if default.args else REQUIRED
        elif isinstance(default, ast.Call) and isinstance(default.func, ast.Name) and default.func.id == "Depends":
            continue
        elif name in ("Request", "Response", "BackgroundTasks", "WebSocket", "RawRequest"):
            continue
        elif name in ("int", "float", "str", "bool") or _is_optional_scalar(arg.annotation):
            query[arg.arg] = REQUIRED if default is None else _literal(default)
        elif name is not None and body is None and name[:1].isupper():
            body = name
    return body, query


def _is_optional_scalar(ann: ast.expr | None) -> bool:
    return (
        isinstance(ann, ast.Subscript)
        and isinstance(ann.value, ast.Name)
        and ann.value.id == "Optional"
        and isinstance(ann.slice, ast.Name)
        and ann.slice.id in ("int", "float", "str", "bool")
    )


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def _structs(module: ast.Module) -> dict[str, dict[str, SourceField]]:
    own: dict[str, dict[str, SourceField]] = {}
    bases: dict[str, list[str]] = {}
    for node in module.body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
        fields: dict[str, SourceField] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            if "ClassVar" in ast.unparse(stmt.annotation):
                continue
            fields[stmt.target.id] = SourceField(stmt.target.id, _field_default(stmt.value))
        own[node.name] = fields

    def resolved(name: str, seen: tuple[str, ...] = ()) -> dict[str, SourceField]:
        merged: dict[str, SourceField] = {}
        for base in bases.get(name, []):
            if base in own and base not in seen:
                merged.update(resolved(base, (*seen, name)))
        merged.update(own.get(name, {}))
        return merged

    return {name: resolved(name) for name in own}


def _field_default(value: ast.expr | None) -> Any:
    if value is None:
        return REQUIRED
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return _literal(kw.value)
            if kw.arg == "default_factory":
                return FACTORY
        return REQUIRED
    return _literal(value)


def _open_prefixes(module: ast.Module) -> tuple[str, ...]:
    for fn in _functions(module):
        if fn.name != "decide_request_auth":
            continue
        prefixes = []
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
                if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                    prefixes.append(node.args[0].value)
        return tuple(prefixes)
    return ()
