"""Walk a FastAPI app's routes, included routers too, on every FastAPI version we support.

FastAPI 0.1xx with Starlette 1.x keeps ``include_router`` results as ``_IncludedRouter`` entries that have neither
``path`` nor ``methods``: reading ``app.routes`` flat sees no route at all. Each such entry holds the router it
includes (``original_router``) and the prefix (``include_context.prefix``); older FastAPI copies the routes in flat.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["RouteInfo", "iter_routes"]


@dataclass(frozen=True, slots=True)
class RouteInfo:
    """One HTTP route: its path, its methods (HEAD left out) and the endpoint function."""

    path: str
    methods: frozenset[str]
    endpoint: Callable[..., Any] | None


def iter_routes(routes: Iterable[Any], prefix: str = "") -> Iterator[RouteInfo]:
    """Every HTTP route under ``routes`` (``app.routes``), included routers walked with their prefix."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            context = getattr(route, "include_context", None)
            yield from iter_routes(included.routes, prefix + str(getattr(context, "prefix", "") or ""))
            continue
        path = getattr(route, "path", None)
        methods = getattr(route, "methods", None)
        if isinstance(path, str) and methods:
            yield RouteInfo(prefix + path, frozenset(m for m in methods if m != "HEAD"), getattr(route, "endpoint", None))
