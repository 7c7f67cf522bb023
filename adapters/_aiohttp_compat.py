"""Which aiohttp ``ResilientMiddleware`` runs on: the versions its tests cover, and a check of the internals it reads.

aiohttp gives a client middleware no public way to do these things the
middleware needs, so on the versions it is tested with (3.12 to 3.14) it reads
aiohttp's own code:

- the caller's ``ClientTimeout``: kept as ``real_timeout`` in the closure of
  the handler the middlewares wrap (``ClientSession._request``'s
  ``_connect_and_send_request``), reached through ``build_client_middlewares``'
  ``next_h`` cells. aiohttp 3.15 adds the public ``ClientRequest.timeout``
  (aio-libs/aiohttp#13176, backported in #13211); where it exists the
  middleware reads that, and these two are not needed;
- aiohttp's own re-run of a request (``retry_persistent_connection``): the
  re-run gets a new ``ClientRequest`` with the same ``_timer``;
- the body-less 200 returned when a probe confirms an ambiguous request: a
  ``ClientResponse`` never started on a connection, given ``_headers``,
  ``_raw_headers`` and ``_body``; and each attempt's timer wraps the
  request's ``send``, which ``_connect_and_send_request`` calls;
- the control lane (``control_pools.AiohttpLane``): it swaps the session's
  ``_connector``, which ``_connect_and_send_request`` reads when it runs, and
  the middleware reads a request's session as ``_session``.

``check(version, missing)`` runs when ``resilience.adapters.aiohttp`` is imported (what it refuses: its docstring).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from types import CodeType, ModuleType

__all__ = ["TESTED", "check", "internals_missing", "parse_version"]

TESTED: tuple[tuple[int, int], tuple[int, int]] = ((3, 12), (3, 15))
"""The aiohttp versions the tests cover: from 3.12 (client middlewares) up to, not including, 3.15 (pyproject's extra)."""


def parse_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``3.14.5`` or ``4.0.0a1``; ``(0, 0)`` when it has none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _codes(code: CodeType) -> Iterator[CodeType]:
    """``code`` and every function compiled inside it (nested ``def``s are constants of their parent's code)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _codes(const)


def _nested(function: object, name: str) -> CodeType | None:
    code = getattr(function, "__code__", None)
    if not isinstance(code, CodeType):
        return None
    return next((c for c in _codes(code) if c.co_name == name), None)


def _reads(function: object, attribute: str) -> bool:
    """Whether ``function`` (a function, a property, or aiohttp's ``reify`` around one) reads ``self.<attribute>``."""
    for unwrap in ("fget", "wrapped"):  # property, reify
        function = getattr(function, unwrap, None) or function
    code = getattr(function, "__code__", None)
    return isinstance(code, CodeType) and attribute in code.co_names


def internals_missing(aiohttp: ModuleType) -> list[str]:
    """The internals the middleware reads that ``aiohttp`` (the imported module) does not have, each named; [] when all are there."""
    session = getattr(aiohttp, "ClientSession", None)
    request = getattr(aiohttp, "ClientRequest", None)
    response = getattr(aiohttp, "ClientResponse", None)
    if session is None or request is None or response is None:
        return ["aiohttp.ClientSession, ClientRequest and ClientResponse"]
    missing: list[str] = []
    inner = _nested(getattr(session, "_request", None), "_connect_and_send_request")
    if inner is None:
        missing.append("ClientSession._request's _connect_and_send_request handler")
    elif "send" not in inner.co_names:
        missing.append("_connect_and_send_request calling req.send(conn)")
    elif "_connector" not in inner.co_names or "self" not in inner.co_freevars:
        missing.append("_connect_and_send_request reading self._connector when it runs (the control lane swaps it)")
    if not isinstance(getattr(request, "timeout", None), property):  # no public timeout: the closure cells are read
        if inner is not None and "real_timeout" not in inner.co_freevars:
            missing.append("_connect_and_send_request's real_timeout cell")
        middlewares = getattr(aiohttp, "client_middlewares", None)
        wrapped = _nested(getattr(middlewares, "build_client_middlewares", None), "wrapped")
        if wrapped is None or "next_h" not in wrapped.co_freevars:
            missing.append("build_client_middlewares' next_h cell")
    if not _reads(getattr(request, "__init__", None), "_timer"):
        missing.append("ClientRequest._timer")
    if not _reads(getattr(request, "session", None), "_session"):
        missing.append("ClientRequest.session")
    for attribute, reader in (("_headers", "headers"), ("_raw_headers", "raw_headers"), ("_body", "read")):
        descriptor = next((vars(k)[reader] for k in response.__mro__ if reader in vars(k)), None)
        if not hasattr(response, attribute) or not _reads(descriptor, attribute):
            missing.append(f"ClientResponse.{attribute} (read by ClientResponse.{reader})")
    return missing


def check(version: str, missing: list[str]) -> None:
    """Refuse an aiohttp the middleware cannot run on (``ImportError`` naming its version and what differs); warn on a newer one."""
    found = parse_version(version)
    low, high = TESTED
    supported = f"aiohttp>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    if found < low:
        raise ImportError(
            f"resilience.adapters.aiohttp needs client middlewares (aiohttp {low[0]}.{low[1]} or later), "
            f"but aiohttp {version} is installed; install {supported!r}"
        )
    if missing:
        raise ImportError(
            f"resilience.adapters.aiohttp reads aiohttp internals that aiohttp {version} does not have: {'; '.join(missing)}. "
            f"It is tested on {supported!r}; install that, or use the httpx transport (resilience.adapters.httpx)"
        )
    if found >= high:
        warnings.warn(
            f"aiohttp {version} is newer than the versions resilience.adapters.aiohttp is tested on ({supported}); "
            "the internals it reads are all there, so it runs",
            RuntimeWarning,
            stacklevel=3,
        )
