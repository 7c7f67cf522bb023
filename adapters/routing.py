"""What a request's method and URL decide, its engine (``engine_of``) and policy match, worked out once per URL (``RouteCache``).

Every driver turns each request into a ``CallSpec``: the endpoint policy
(``PolicyTable.match`` on the method and path) and the engine
(``scheme://host:port``, ``engine_of``). Control planes call the same few
URLs over and over, so the drivers keep those answers per (method, URL less
its query string) and parse a URL only the first time they see it. The cache
is bounded (``ROUTE_CACHE_SIZE`` entries; it is emptied when full, so a caller
that sends to unbounded distinct paths costs a parse per call, never memory),
and it holds the answers of one ``PolicyTable``, the driver's.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from resilience.policy import EndpointMatch, PolicyTable

__all__ = ["ROUTE_CACHE_SIZE", "Route", "RouteCache", "engine_of", "route_of"]

_DEFAULT_PORTS = {"http": 80, "https": 443}

ROUTE_CACHE_SIZE = 1024
"""The most (method, URL) answers a ``RouteCache`` holds; a full cache is emptied before the next one is kept."""

def engine_of(url: str) -> tuple[str, str, int]:
    """``(scheme://host:port, host, port)`` of a URL, without user-info, path or query."""
    parts = urlsplit(url)
    scheme = (parts.scheme or "http").lower()
    host = parts.hostname or ""
    port = parts.port or _DEFAULT_PORTS.get(scheme, 0)
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}", host, port


Route = tuple[str, EndpointMatch, str, str, int]
"""(the method upper-cased, the policy match, the engine ``scheme://host:port``, the host, the port)."""


class RouteCache:
    """(method, URL less its query) -> ``Route`` under one ``PolicyTable``; one per driver instance.

    ``build(policies, method, url)`` works out a ``Route`` the first time a
    (method, URL) is seen. A driver's table never changes (its
    ``DriverConfig`` is frozen), so the cache is built with it. Reads and
    writes of a dict are atomic under the GIL, so threads and event loops
    share it without a lock (two that miss at once both build the same answer).
    """

    __slots__ = ("_build", "_policies", "_routes")

    def __init__(self, policies: PolicyTable, build: Callable[[PolicyTable, str, str], Route]) -> None:
        self._policies = policies
        self._build = build
        self._routes: dict[tuple[str, str], Route] = {}

    def route(self, method: str, url: str) -> Route:
        """The ``Route`` of ``method`` on ``url``; the URL's query, if any, is not part of the key."""
        key = (method, url.partition("?")[0])
        found = self._routes.get(key)
        if found is not None:
            return found
        answer = self._build(self._policies, method, url)
        if len(self._routes) >= ROUTE_CACHE_SIZE:
            self._routes = {}
        self._routes[key] = answer
        return answer


def route_of(policies: PolicyTable, method: str, url: str) -> Route:
    """What ``policies`` and ``engine_of`` decide for ``method`` on ``url`` (a ``build`` for ``RouteCache.route``)."""
    method = method.upper()
    engine, host, port = engine_of(url)
    return method, policies.match(method, urlsplit(url).path), engine, host, port
