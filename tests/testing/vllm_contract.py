"""The vLLM emulator against vLLM 0.33.0's own source: routes, methods, parameters, answer bodies, mounting, keys.

Both sides are read the same way, by AST (``vllm_source.py``): vLLM's dev and RL routers from the wheel (the modules its
registries import), the emulator's from ``dev_routes.py`` and ``rl_routes.py``. Every comparison returns a list of
differences, one line each naming the route and both sides; an empty list means they agree. The inputs are plain
values, so a test can feed a doctored side and see the check fail. :func:`check` runs them all on the wheel and
refuses sets that are empty or of an implausible size.

Compared, in both directions:

- the control routes: the same set of paths, the same methods per path;
- per route, the parameters: the same names, each bound the same way (query, embedded body field, read by hand from
  the query string or the JSON body), with the same annotation as written, default and constraints (``ge``/``le``);
- per route, the answer shapes (keys, and constant values such as ``"status": "sleeping"``): every emulator shape is
  one of vLLM's, and every vLLM shape but its defensive ``{"error": ...}`` answers (and :data:`UNREACHABLE_SHAPES`) is
  the emulator's;
- the mounting: vLLM gates both registries on ``VLLM_SERVER_DEV_MODE`` and reads it as :data:`DEV_MODE_READER`; the
  emulator's dev-mode app serves exactly the control routes (plus the always-mounted ones and ``/_emulator/*``) and
  its plain app none of them;
- the always-mounted routes the emulator serves exist in vLLM with the same methods, and the ``--api-key`` prefixes
  are vLLM's;
- the fault-tolerance routes (``serve/fault_tolerance/api_router.py``): paths, methods, parameters and answers as
  above, and the mounting: vLLM registers them under ``enable_fault_tolerance``, the emulator serves them exactly when
  ``enable_fault_tolerance`` is on (dev mode or not).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from resilience.testing.emulator.vllm.config import DEV_MODE_ENV, VLLM_VERSION
from tests.testing.sglang_contract import ContractReport
from tests.testing.vllm_source import RouteSpec, VllmSurface, read_vllm_surface, routes_in_source

__all__ = [
    "DEV_MODE_READER", "UNREACHABLE_SHAPES", "app_paths", "check", "compare_bodies", "compare_fault_tolerance", "compare_mounting",
    "compare_params", "compare_routes", "compare_serve_routes", "emulator_control_routes", "emulator_fault_tolerance_routes",
]  # fmt: skip

DEV_MODE_READER = '"VLLM_SERVER_DEV_MODE": lambda: bool(int(os.getenv("VLLM_SERVER_DEV_MODE", "0"))),'
"""``vllm/envs.py`` l.1468, which ``config.dev_mode_from_env`` follows."""
UNREACHABLE_SHAPES = frozenset({("/collective_rpc", ())})
"""vLLM answers the emulator never gives, with why: ``/collective_rpc``'s empty 200 needs a
``collective_rpc`` that returns None (``serve/dev/rpc/api_router.py`` l.51-52), and vLLM's returns a list."""
SERVE_PATHS = ("/health", "/version", "/v1/models", "/v1/completions")
"""The always-mounted routes the emulator serves."""
MIN_CONTROL_ROUTES, MAX_CONTROL_ROUTES = 20, 40
MIN_PARAMS = 12
MIN_ALL_ROUTES = 50
FT_REGISTRY = "register_fault_tolerance_api_router"
"""What ``register_api_routers`` calls under ``if getattr(args, "enable_fault_tolerance", False):`` (routers.py l.85-90)."""


def emulator_control_routes() -> dict[str, RouteSpec]:
    """The emulator's dev and RL routes, read from its source by AST as vLLM's are."""
    from resilience.testing.emulator.vllm import dev_routes, rl_routes

    found: dict[str, RouteSpec] = {}
    for module in (dev_routes, rl_routes):
        found.update(routes_in_source(inspect.getsource(module), module.__name__))
    return found


def emulator_fault_tolerance_routes() -> dict[str, RouteSpec]:
    """The emulator's fault-tolerance routes, read from its source by AST."""
    from resilience.testing.emulator.vllm import ft_routes

    return routes_in_source(inspect.getsource(ft_routes), ft_routes.__name__)


def compare_routes(vllm: Mapping[str, RouteSpec], ours: Mapping[str, RouteSpec]) -> list[str]:
    """Control routes only on one side, and methods that differ."""
    problems = [f"route {p}: the emulator serves it, vLLM {VLLM_VERSION} has no such control route" for p in sorted(set(ours) - set(vllm))]
    problems += [f"route {p}: vLLM {VLLM_VERSION} has it ({vllm[p].module}), the emulator does not" for p in sorted(set(vllm) - set(ours))]
    for path in sorted(set(vllm) & set(ours)):
        if vllm[path].methods != ours[path].methods:
            problems.append(f"route {path}: methods {sorted(ours[path].methods)} in the emulator, {sorted(vllm[path].methods)} in vLLM")
    return problems


def compare_params(vllm: Mapping[str, RouteSpec], ours: Mapping[str, RouteSpec]) -> list[str]:
    """Per shared route: parameters only on one side, or bound, typed, defaulted or constrained differently."""
    problems: list[str] = []
    for path in sorted(set(vllm) & set(ours)):
        theirs, mine = vllm[path].params, ours[path].params
        for name in sorted(set(mine) - set(theirs)):
            problems.append(f"route {path}: parameter {name!r} only in the emulator")
        for name in sorted(set(theirs) - set(mine)):
            problems.append(f"route {path}: parameter {name!r} ({theirs[name].where}) only in vLLM")
        for name in sorted(set(theirs) & set(mine)):
            a, b = mine[name], theirs[name]
            for what in ("where", "annotation", "default", "constraints"):
                if getattr(a, what) != getattr(b, what):
                    problems.append(
                        f"route {path}: parameter {name!r} {what} {getattr(a, what)!r} in the emulator, {getattr(b, what)!r} in vLLM"
                    )
    return problems


def _is_error_shape(shape: tuple[tuple[str, Any], ...]) -> bool:
    return tuple(k for k, _ in shape) == ("error",)


def compare_bodies(
    vllm: Mapping[str, RouteSpec], ours: Mapping[str, RouteSpec], unreachable: Iterable[tuple[str, Any]] = UNREACHABLE_SHAPES
) -> list[str]:
    """Per shared route: answer shapes the emulator gives that vLLM never does, and vLLM's (but errors) the emulator lacks."""
    skip = set(unreachable)
    problems: list[str] = []
    for path in sorted(set(vllm) & set(ours)):
        theirs, mine = vllm[path].bodies, ours[path].bodies
        for shape in sorted(mine - theirs, key=repr):
            problems.append(f"route {path}: the emulator answers {dict(shape)!r}, vLLM never does")
        for shape in sorted(theirs - mine, key=repr):
            if not _is_error_shape(shape) and (path, shape) not in skip:
                problems.append(f"route {path}: vLLM answers {dict(shape)!r}, the emulator never does")
        if not theirs or not mine:
            problems.append(f"route {path}: no answer read ({len(mine)} in the emulator, {len(theirs)} in vLLM)")
    return problems


Paths = set[tuple[str, str]]
"""The ``(method, path)`` pairs an app serves (:func:`app_paths`)."""


def app_paths(app: Any) -> Paths:
    """Every ``(method, path)`` an app serves, included routers too."""
    from resilience.testing.emulator.routes import iter_routes

    return {(m, r.path) for r in iter_routes(app.routes) for m in r.methods}


def compare_mounting(surface: VllmSurface, control: Mapping[str, RouteSpec], dev_app_paths: Paths, plain_app_paths: Paths) -> list[str]:
    """vLLM's dev-mode gate and env reader, and whether the emulator mounts the control routes exactly when dev mode is on."""
    problems: list[str] = []
    for registry in ("register_vllm_dev_api_routers", "register_rl_api_routers"):
        if registry not in surface.dev_mode_gated:
            problems.append(f"vLLM's register_api_routers does not call {registry} under `if envs.{DEV_MODE_ENV}:`")
    if surface.dev_mode_env != DEV_MODE_READER:
        problems.append(f"vLLM reads {DEV_MODE_ENV} as {surface.dev_mode_env!r}, the emulator as {DEV_MODE_READER!r}")
    wanted = {(m, r.path) for r in control.values() for m in r.methods}
    extra = {(m, p) for m, p in dev_app_paths if not p.startswith("/_emulator/") and p not in SERVE_PATHS}
    for method, path in sorted(extra - wanted):
        problems.append(f"dev mode on: the emulator's app serves {method} {path}, which is no control route")
    return problems + _mounted_when("dev mode", control, dev_app_paths, plain_app_paths)


def _mounted_when(switch: str, routes: Mapping[str, RouteSpec], on_paths: Paths, off_paths: Paths) -> list[str]:
    """What is wrong with the emulator serving ``routes`` exactly when ``switch`` is on: the app built with it on
    serves ``on_paths``, with it off ``off_paths``."""
    wanted = {(m, r.path) for r in routes.values() for m in r.methods}
    missing = [f"{switch} on: the emulator's app does not serve {m} {p}" for m, p in sorted(wanted - on_paths)]
    return missing + [f"{switch} off: the emulator's app serves {m} {p} (vLLM answers 404)" for m, p in sorted(wanted & off_paths)]


def compare_serve_routes(surface: VllmSurface, served: Paths, guarded_prefix: tuple[str, ...]) -> list[str]:
    """The always-mounted routes the emulator serves exist in vLLM with those methods; the key guards the same prefixes."""
    problems: list[str] = []
    for path in SERVE_PATHS:
        theirs = surface.all_routes.get(path)
        mine = frozenset(m for m, p in served if p == path)
        if theirs is None:
            problems.append(f"route {path}: vLLM {surface.version} has no such route")
        elif mine != theirs.methods:
            problems.append(f"route {path}: methods {sorted(mine)} in the emulator, {sorted(theirs.methods)} in vLLM")
    if guarded_prefix != surface.guarded_prefix:
        problems.append(f"--api-key guards {guarded_prefix} in the emulator, {surface.guarded_prefix} in vLLM")
    return problems


def compare_fault_tolerance(surface: VllmSurface, ours: Mapping[str, RouteSpec], ft_app_paths: Paths, plain_app_paths: Paths) -> list[str]:
    """The fault-tolerance routes as the control routes are compared, and mounted only with ``enable_fault_tolerance``."""
    theirs = surface.fault_tolerance
    problems = compare_routes(theirs, ours) + compare_params(theirs, ours) + compare_bodies(theirs, ours)
    if FT_REGISTRY not in surface.fault_tolerance_gated:
        problems.append(f"vLLM's register_api_routers does not call {FT_REGISTRY} under `if ... enable_fault_tolerance ...:`")
    return problems + _mounted_when("fault tolerance", ours, ft_app_paths, plain_app_paths)


def check(wheel: str | Path) -> ContractReport:
    """Read the wheel, read the emulator, build its app with dev mode on and off, run every comparison.

    Raises AssertionError when a compared set is empty or of an implausible size: a check over
    nothing (or over the wrong files) would pass whatever the emulator did.
    """
    from resilience.testing.emulator.auth import GUARDED_PREFIX
    from resilience.testing.emulator.vllm.app import create_app
    from resilience.testing.emulator.vllm.config import VLLMEngineConfig

    surface = read_vllm_surface(wheel)
    ours = emulator_control_routes()
    dev_paths = app_paths(create_app(VLLMEngineConfig(dev_mode=True))[0])
    plain_paths = app_paths(create_app(VLLMEngineConfig(dev_mode=False))[0])
    ft_paths = app_paths(create_app(VLLMEngineConfig(dev_mode=False, enable_fault_tolerance=True))[0])
    ft_ours = emulator_fault_tolerance_routes()
    sizes = {
        "vllm_control_routes": len(surface.control),
        "emulator_control_routes": len(ours),
        "vllm_control_modules": len(surface.control_modules),
        "vllm_params": sum(len(r.params) for r in surface.control.values()),
        "emulator_params": sum(len(r.params) for r in ours.values()),
        "vllm_bodies": sum(len(r.bodies) for r in surface.control.values()),
        "emulator_bodies": sum(len(r.bodies) for r in ours.values()),
        "vllm_all_routes": len(surface.all_routes),
        "emulator_app_routes": len(dev_paths),
        "vllm_fault_tolerance_routes": len(surface.fault_tolerance),
        "emulator_fault_tolerance_routes": len(ft_ours),
    }
    for name in ("vllm_control_routes", "emulator_control_routes"):
        assert MIN_CONTROL_ROUTES <= sizes[name] <= MAX_CONTROL_ROUTES, f"contract: {name} has {sizes[name]} entries, not a plausible size"
    for name in ("vllm_params", "emulator_params"):
        assert sizes[name] >= MIN_PARAMS, f"contract: {name} has {sizes[name]} entries, fewer than a real surface has"
    for name in ("vllm_bodies", "emulator_bodies"):
        assert sizes[name] >= sizes["vllm_control_routes"], f"contract: {name} has {sizes[name]} entries, fewer than one per route"
    assert sizes["vllm_control_modules"] >= 5, f"contract: vLLM's registries import {sizes['vllm_control_modules']} router modules"
    assert sizes["vllm_all_routes"] >= MIN_ALL_ROUTES, f"contract: vLLM's entrypoints have {sizes['vllm_all_routes']} routes"
    assert surface.guarded_prefix and surface.dev_mode_gated, "contract: the auth prefixes or the dev-mode gate were not found"
    ft_routes = sizes["vllm_fault_tolerance_routes"]
    assert ft_routes == 2, f"contract: vLLM's fault-tolerance router has {ft_routes} routes, not apply and status"
    problems = [] if surface.version == VLLM_VERSION else [f"the wheel is vLLM {surface.version}, the emulator reproduces {VLLM_VERSION}"]
    problems += (
        compare_routes(surface.control, ours)
        + compare_params(surface.control, ours)
        + compare_bodies(surface.control, ours)
        + compare_mounting(surface, ours, dev_paths, plain_paths)
        + compare_serve_routes(surface, dev_paths, GUARDED_PREFIX)
        + compare_fault_tolerance(surface, ft_ours, ft_paths, dev_paths)
    )
    return ContractReport(surface.version, sizes, tuple(problems))
