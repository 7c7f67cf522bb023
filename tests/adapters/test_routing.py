"""``resilience.adapters.routing``: a URL's engine, and the per-driver cache of what a request's method and URL decide."""

from __future__ import annotations

import pytest

from resilience import EndpointPolicy, PolicyTable
from resilience.adapters.routing import ROUTE_CACHE_SIZE, Route, RouteCache, engine_of, route_of


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:30000/pause_generation?x=1", ("http://127.0.0.1:30000", "127.0.0.1", 30000)),
        ("HTTPS://user:secret@Example.org/x", ("https://example.org:443", "example.org", 443)),
        ("http://[::1]/x", ("http://[::1]:80", "::1", 80)),
    ],
)
def test_engine_of_drops_user_info_path_and_query(url: str, expected: tuple[str, str, int]) -> None:
    assert engine_of(url) == expected


class Counting:
    """``route_of``, counting how often the cache asked it."""

    def __init__(self) -> None:
        self.built: list[tuple[str, str]] = []

    def __call__(self, policies: PolicyTable, method: str, url: str) -> Route:
        self.built.append((method, url))
        return route_of(policies, method, url)


TABLE = PolicyTable({"POST /release_memory_occupation": EndpointPolicy(idempotent=False, attempt_timeout_s=5)})


def test_one_parse_per_method_and_url_less_its_query() -> None:
    build = Counting()
    cache = RouteCache(TABLE, build)
    url = "http://127.0.0.1:1/release_memory_occupation"
    first = cache.route("post", url + "?tags=kv_cache")
    again = cache.route("post", url + "?tags=weights")
    other = cache.route("get", url)
    assert first is again
    assert len(build.built) == 2
    method, match, engine, host, port = first
    assert (method, match.endpoint, match.own_timeout_s, engine, host, port) == (
        "POST",
        "POST /release_memory_occupation",
        5.0,
        "http://127.0.0.1:1",
        "127.0.0.1",
        1,
    )
    assert other[1].endpoint == "GET *"


def test_bounded_a_full_cache_is_emptied() -> None:
    build = Counting()
    cache = RouteCache(TABLE, build)
    for i in range(ROUTE_CACHE_SIZE + 5):
        cache.route("GET", f"http://127.0.0.1:1/item/{i}")
    assert len(cache.routes) == 5  # emptied once at ROUTE_CACHE_SIZE, then refilled
    cache.route("GET", f"http://127.0.0.1:1/item/{ROUTE_CACHE_SIZE + 4}")
    assert len(build.built) == ROUTE_CACHE_SIZE + 5  # the last URL was still cached


@pytest.mark.parametrize("parsed", [True, False], ids=["httpx's parsed URL", "str(url)"])
def test_httpx_keys_its_route_by_the_parsed_url_as_by_the_string(monkeypatch: pytest.MonkeyPatch, parsed: bool) -> None:
    """Either key (httpx's ``URL._uri_reference`` parts, or the string where httpx has none) routes alike, query aside."""
    import httpx

    from resilience.adapters import httpx as driver

    monkeypatch.setattr(driver, "_PARSED", parsed)
    table = PolicyTable({"POST /flush_cache": EndpointPolicy(), "GET /v1/models/{model}": EndpointPolicy()})
    transport = driver.ResilientTransport(table)
    try:
        specs = [
            transport._spec(httpx.Request(method, url))[0]
            for method, url in [
                ("POST", "http://127.0.0.1:30000/flush_cache?x=1"),
                ("POST", "http://127.0.0.1:30000/flush_cache?x=2"),
                ("GET", "http://[::1]:8000/v1/models/m"),
                ("POST", "https://user:secret@Example.org/other"),
            ]
        ]
    finally:
        transport.close()
    got = [(s.method, s.match.endpoint, s.engine, s.server_address, s.server_port, str(s.url)) for s in specs]
    assert got == [
        ("POST", "POST /flush_cache", "http://127.0.0.1:30000", "127.0.0.1", 30000, "http://127.0.0.1:30000/flush_cache?x=1"),
        ("POST", "POST /flush_cache", "http://127.0.0.1:30000", "127.0.0.1", 30000, "http://127.0.0.1:30000/flush_cache?x=2"),
        ("GET", "GET /v1/models/{model}", "http://[::1]:8000", "::1", 8000, "http://[::1]:8000/v1/models/m"),
        ("POST", "POST *", "https://example.org:443", "example.org", 443, "https://user:secret@example.org/other"),
    ]
    assert len(transport._routes.routes) == 3  # the query is not part of either key
