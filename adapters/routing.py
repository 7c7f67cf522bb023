"""What a request's method and URL decide, its engine (``engine_of``) and policy match, worked out once per URL (``RouteCache``).

Every driver turns each request into a ``CallSpec``: the endpoint policy (``PolicyTable.match`` on the method and path)
and the engine (``scheme://host:port``, ``engine_of``). Control planes call the same few URLs over and over, so the
drivers keep those answers per (method, URL less its query string) and parse a URL only the first time they see it. The
cache is bounded (``ROUTE_CACHE_SIZE`` entries; it is emptied when full, so a caller that sends to unbounded distinct
paths costs a parse per call, never memory), and it holds the answers of one ``PolicyTable``, the driver's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar
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
T = TypeVar("T")


class RouteCache(Generic[T]):
    """A ``Route`` per (method, URL less its query) under one ``PolicyTable``; one per driver instance.

    ``build(policies, method, url)`` works out a ``Route`` (or whatever else the driver decides once per route:
    ``control_lane.routed`` adds whether it takes the lane) the first time a (method, URL) is seen. A driver's table
    never changes (its ``DriverConfig`` is frozen), so the cache is built with it. Reads and writes of a dict are atomic
    under the GIL, so threads and event loops share it without a lock (two that miss at once both build the same
    answer). ``route`` keys by the URL string; a driver whose URL object holds its parts already (httpx, yarl) looks its
    own key up in ``routes`` (a subscript: no call on a hit) and calls ``add`` on a miss, so no URL is turned into a
    string on the way.
    """

    __slots__ = ("_build", "_policies", "routes")

    def __init__(self, policies: PolicyTable, build: Callable[[PolicyTable, str, str], T]) -> None:
        self._policies = policies
        self._build = build
        self.routes: dict[Hashable, T] = {}
        """key -> ``Route``: (method, URL less its query) for ``route``, the driver's own key for ``add``."""

    def route(self, method: str, url: str) -> T:
        """The ``Route`` of ``method`` on ``url``; the URL's query, if any, is not part of the key."""
        key = (method, url.partition("?")[0])
        try:
            return self.routes[key]
        except KeyError:
            return self.add(key, method, url)

    def add(self, key: Hashable, method: str, url: str) -> T:
        """Work out the ``Route`` of ``method`` on ``url`` and keep it under ``key`` (a full cache is emptied first)."""
        answer = self._build(self._policies, method, url)
        if len(self.routes) >= ROUTE_CACHE_SIZE:
            self.routes = {}
        self.routes[key] = answer
        return answer


def route_of(policies: PolicyTable, method: str, url: str) -> Route:
    """What ``policies`` and ``engine_of`` decide for ``method`` on ``url`` (a ``build`` for ``RouteCache.route``)."""
    method = method.upper()
    engine, host, port = engine_of(url)
    return method, policies.match(method, urlsplit(url).path), engine, host, port
