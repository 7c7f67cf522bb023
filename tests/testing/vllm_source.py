"""Read FastAPI routes out of Python source by AST: vLLM 0.33.0's, from its wheel, and the emulator's, the same way.

Nothing of vLLM is imported (it needs CUDA torch); the wheel is a zip read in place. For each function decorated
``@<router>.<get|post|put|delete|patch>("/path")`` (or ``api_route(..., methods=[...])``), :func:`routes_in_source`
records:

- the parameters FastAPI binds: name, where (``query``, ``body`` for ``Body(embed=True)``, ``model`` for a pydantic
  body), the annotation as written, the default (:data:`REQUIRED` when none) and the constraints (``ge``, ``le``,
  ...);
- the parameters the handler reads by hand: ``request.query_params.getlist("x")`` / ``.get("x")`` (where
  ``query-hand``) and ``body.get("x", default)`` on the JSON body (where ``json``);
- the shapes of its answers: every ``JSONResponse(content=...)`` / ``Response(...)`` it builds, as the sorted ``(key,
  value)`` pairs of the content dict, a value kept when it is a constant (``"a|b"`` for ``"a" if c else "b"``), else
  ``"*"``; ``()`` is an empty body.

:func:`read_vllm_surface` follows vLLM's own mounting: the modules that ``register_vllm_dev_api_routers``
(``serve/__init__.py``) and ``register_rl_api_routers`` (``rl/factories.py``) import, and the gate around them in
``launchers/api_server/routers.py``.
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.testing.engine_wheel import wheel_version

__all__ = ["HAND", "REQUIRED", "Param", "RouteSpec", "VllmSurface", "read_vllm_surface", "routes_in_source"]

REQUIRED = "<required>"
"""The default of a parameter that has none."""
HAND = "<read by hand>"
"""The default of a parameter the handler reads itself (FastAPI does not bind it)."""

_METHODS = ("get", "post", "put", "delete", "patch")
_MARKERS = {"Query": "query", "Body": "body", "Path": "path", "Header": "header"}
_DEV_REGISTRY = "vllm/entrypoints/serve/__init__.py"
_RL_REGISTRY = "vllm/entrypoints/rl/factories.py"
_MOUNT = "vllm/entrypoints/launchers/api_server/routers.py"
_AUTH = "vllm/entrypoints/serve/middleware/authenticate.py"
_ENVS = "vllm/envs.py"
FAULT_TOLERANCE_ROUTER = "vllm/entrypoints/serve/fault_tolerance/api_router.py"
"""Where 0.33.0 defines ``/fault_tolerance/apply`` and ``/fault_tolerance/status``."""


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a route, as its source declares or reads it."""

    name: str
    where: str
    annotation: str = ""
    default: Any = REQUIRED
    constraints: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """One route: path, methods, the function, its parameters by name, its answer shapes, and where it was read."""

    path: str
    methods: frozenset[str]
    function: str
    params: Mapping[str, Param] = field(default_factory=dict)
    bodies: frozenset[tuple[tuple[str, Any], ...]] = frozenset()
    module: str = ""


@dataclass(frozen=True, slots=True)
class VllmSurface:
    """What :func:`read_vllm_surface` read from the wheel."""

    version: str
    control: Mapping[str, RouteSpec]
    """The dev and RL routes (mounted only in dev mode), by path."""
    all_routes: Mapping[str, RouteSpec]
    """Every route under ``vllm/entrypoints`` (for the always-mounted ones the emulator also serves)."""
    control_modules: tuple[str, ...]
    """The files the dev and RL registries import their routers from."""
    dev_mode_gated: frozenset[str]
    """The registry calls found under ``if envs.VLLM_SERVER_DEV_MODE:`` in ``register_api_routers``."""
    dev_mode_env: str
    """The source of ``VLLM_SERVER_DEV_MODE``'s reader in ``envs.py``."""
    guarded_prefix: tuple[str, ...]
    """``GUARDED_PREFIX`` of the ``--api-key`` middleware."""
    fault_tolerance: Mapping[str, RouteSpec] = field(default_factory=dict)
    """The fault-tolerance routes (``FAULT_TOLERANCE_ROUTER``), by path."""
    fault_tolerance_gated: frozenset[str] = frozenset()
    """The calls found under ``if ... enable_fault_tolerance ...:`` in ``register_api_routers``."""


def _literal(node: ast.expr | None) -> Any:
    if node is None:
        return REQUIRED
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return ast.unparse(node)


def _marker(node: ast.expr) -> tuple[str, ast.Call] | None:
    """``Query(...)``/``Body(...)``... as (where, the call), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _MARKERS:
        return _MARKERS[node.func.id], node
    return None


def _constraints(call: ast.Call) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k.arg, _literal(k.value)) for k in call.keywords if k.arg not in (None, "default", "embed")))


def _param(arg: ast.arg, default: ast.expr | None) -> Param | None:
    annotation = arg.annotation
    text = ast.unparse(annotation) if annotation is not None else ""
    if text in ("Request", "Response") or text.endswith(".Request"):
        return None
    where, marked = "query", False
    constraints: tuple[tuple[str, Any], ...] = ()
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name) and annotation.value.id == "Annotated":
        elements = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        text = ast.unparse(elements[0])
        for extra in elements[1:]:
            found = _marker(extra)
            if found is not None:
                (where, call), marked = found, True
                constraints = _constraints(call)
    value = _literal(default)
    if default is not None and (found := _marker(default)) is not None:
        (where, call), marked = found, True
        constraints = _constraints(call)
        inner = next((k.value for k in call.keywords if k.arg == "default"), call.args[0] if call.args else None)
        value = _literal(inner)
    elif not marked and isinstance(annotation, ast.Name) and annotation.id[:1].isupper():
        where = "model"  # a class annotation without a marker: a pydantic body (FastAPI binds simple types to the query)
    return Param(arg.arg, where, text, value, constraints)


def _shape(node: ast.expr | None, assigned: Mapping[str, ast.expr]) -> tuple[tuple[str, Any], ...] | None:
    if node is None:
        return ()
    if isinstance(node, ast.Name) and node.id in assigned:
        node = assigned[node.id]
    if not isinstance(node, ast.Dict):
        return (("*", "*"),)
    pairs = []
    for key, value in zip(node.keys, node.values, strict=True):
        name = _literal(key) if key is not None else "**"
        if isinstance(value, ast.Constant):
            shown: Any = value.value
        elif isinstance(value, ast.IfExp) and isinstance(value.body, ast.Constant) and isinstance(value.orelse, ast.Constant):
            shown = "|".join(sorted(str(v) for v in (value.body.value, value.orelse.value)))
        else:
            shown = "*"
        pairs.append((str(name), shown))
    return tuple(sorted(pairs))


def _answers(function: ast.AsyncFunctionDef | ast.FunctionDef) -> frozenset[tuple[tuple[str, Any], ...]]:
    assigned: dict[str, ast.expr] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned[node.targets[0].id] = node.value
    shapes = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("JSONResponse", "Response"):
            content = next((k.value for k in node.keywords if k.arg == "content"), node.args[0] if node.args else None)
            shape = _shape(content, assigned)
            if shape is not None:
                shapes.add(shape)
    return frozenset(shapes)


def _hand_reads(function: ast.AsyncFunctionDef | ast.FunctionDef) -> list[Param]:
    """Parameters the handler reads itself: ``query_params.getlist/get("x")`` and ``<json body>.get("x", d)``."""
    bodies: set[str] = set()
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Await)
            and isinstance(node.value.value, ast.Call)
            and isinstance(node.value.value.func, ast.Attribute)
            and node.value.value.func.attr == "json"
        ):
            bodies.add(node.targets[0].id)
    found: list[Param] = []
    for node in ast.walk(function):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
            continue
        key = node.args[0]
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            continue
        owner = node.func.value
        if node.func.attr in ("getlist", "get") and isinstance(owner, ast.Attribute) and owner.attr == "query_params":
            found.append(Param(key.value, "query-hand", node.func.attr, HAND))
        elif node.func.attr == "get" and isinstance(owner, ast.Name) and owner.id in bodies:
            found.append(Param(key.value, "json", "", _literal(node.args[1]) if len(node.args) > 1 else None))
    return found


def _decorated_routes(function: ast.AsyncFunctionDef | ast.FunctionDef) -> list[tuple[str, frozenset[str]]]:
    routes = []
    for decorator in function.decorator_list:
        if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute) and decorator.args):
            continue
        path = _literal(decorator.args[0])
        if not isinstance(path, str) or not path.startswith("/"):
            continue
        verb = decorator.func.attr
        if verb in _METHODS:
            routes.append((path, frozenset({verb.upper()})))
        elif verb == "api_route":
            methods = next((_literal(k.value) for k in decorator.keywords if k.arg == "methods"), ["GET"])
            routes.append((path, frozenset(str(m).upper() for m in methods)))
    return routes


def routes_in_source(text: str, module: str = "") -> dict[str, RouteSpec]:
    """Every decorated route in ``text`` by path (functions nested in factories included); ``module`` labels them."""
    found: dict[str, RouteSpec] = {}
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        decorated = _decorated_routes(node)
        if not decorated:
            continue
        args = node.args.args + node.args.kwonlyargs
        defaults: list[ast.expr | None] = [None] * (len(node.args.args) - len(node.args.defaults)) + list(node.args.defaults)
        defaults += list(node.args.kw_defaults)
        params = {p.name: p for p in (_param(a, d) for a, d in zip(args, defaults, strict=True)) if p is not None}
        for hand in _hand_reads(node):
            params.setdefault(hand.name, hand)
        bodies = _answers(node)
        for path, methods in decorated:
            old = found.get(path)
            if old is not None:
                methods = methods | old.methods
            found[path] = RouteSpec(path, methods, node.name, params, bodies, module)
    return found


def _relative_module(base: str, node: ast.ImportFrom) -> str:
    """The wheel path of ``from .x.y import ...`` written in package ``base`` (``vllm/entrypoints/serve``)."""
    parts = base.split("/")
    if node.level > 1:
        parts = parts[: -(node.level - 1)]
    return "/".join([*parts, *(node.module or "").split(".")]) + ".py"


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    return next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _imported_modules(tree: ast.Module, function: str, base: str) -> list[str]:
    node = _function(tree, function)
    if node is None:
        return []
    return [_relative_module(base, n) for n in ast.walk(node) if isinstance(n, ast.ImportFrom) and n.level >= 1]


def _gated_calls(tree: ast.Module, marker: str = "VLLM_SERVER_DEV_MODE") -> frozenset[str]:
    """The plain calls under an ``if`` of ``register_api_routers`` whose test names ``marker``."""
    node = _function(tree, "register_api_routers")
    gated: set[str] = set()
    for branch in ast.walk(node) if node is not None else ():
        if isinstance(branch, ast.If) and marker in ast.unparse(branch.test):
            for inner in ast.walk(ast.Module(body=branch.body, type_ignores=[])):
                if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name):
                    gated.add(inner.func.id)
    return frozenset(gated)


def read_vllm_surface(wheel: str | Path) -> VllmSurface:
    """Read the dev and RL routes (following vLLM's mounting), every entrypoint route, the gate, the env reader and the auth prefixes."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())

        def source(name: str) -> str:
            return archive.read(name).decode("utf-8") if name in names else ""

        dev = _imported_modules(ast.parse(source(_DEV_REGISTRY)), "register_vllm_dev_api_routers", "vllm/entrypoints/serve")
        rl = _imported_modules(ast.parse(source(_RL_REGISTRY)), "register_rl_api_routers", "vllm/entrypoints/rl")
        modules = tuple(m for m in (*dev, *rl) if m in names)
        control: dict[str, RouteSpec] = {}
        for module in modules:
            control.update(routes_in_source(source(module), module))
        all_routes: dict[str, RouteSpec] = {}
        for name in sorted(n for n in names if n.startswith("vllm/entrypoints/") and n.endswith(".py")):
            text = source(name)
            if "router." in text or "app." in text:
                for path, spec in routes_in_source(text, name).items():
                    all_routes.setdefault(path, spec)
        envs = source(_ENVS)
        env_line = next((line.strip() for line in envs.splitlines() if '"VLLM_SERVER_DEV_MODE": lambda' in line), "")
        prefix: tuple[str, ...] = ()
        for node in ast.walk(ast.parse(source(_AUTH))):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "GUARDED_PREFIX" for t in node.targets):
                prefix = tuple(_literal(node.value))
        return VllmSurface(
            version=wheel_version(archive),
            control=control,
            all_routes=all_routes,
            control_modules=modules,
            dev_mode_gated=_gated_calls(ast.parse(source(_MOUNT))),
            dev_mode_env=env_line,
            guarded_prefix=prefix,
            fault_tolerance=routes_in_source(source(FAULT_TOLERANCE_ROUTER), FAULT_TOLERANCE_ROUTER),
            fault_tolerance_gated=_gated_calls(ast.parse(source(_MOUNT)), "enable_fault_tolerance"),
        )
