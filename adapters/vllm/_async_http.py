"""The sender under ``AsyncVLLMClient``: one ``send`` over an ``aiohttp.ClientSession`` or an ``httpx.AsyncClient``.

Query parameters travel as pairs (``/wake_up?tags=weights&tags=kv_cache``),
which both libraries accept. Nothing here decides what an answer means.
Neither library is imported until a session of that kind exists.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import requests

from resilience.adapters.vllm._shared import answer_records
from resilience.adapters.vllm.calls import Reply, Request
from resilience.errors import ResilienceError

if TYPE_CHECKING:
    import aiohttp
    import httpx

__all__ = ["AsyncSender", "sender_for"]


class AsyncSender(Protocol):
    """Sends one ``Request`` over an async HTTP session."""

    errors: tuple[type[BaseException], ...]
    """What a failed exchange raises (transport errors and the resilience layer's own), for ``health()``."""

    async def send(self, request: Request, url: str, headers: Mapping[str, str] | None, polls: int) -> Reply:
        """Send ``request`` to ``url`` and read the whole answer."""
        ...

    async def aclose(self) -> None:
        """Close the session."""
        ...


class _Aiohttp:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        import aiohttp

        self.session = session
        self.errors: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError, requests.RequestException, ResilienceError)

    async def send(self, request: Request, url: str, headers: Mapping[str, str] | None, polls: int) -> Reply:
        r = request.route
        params = list(request.params) or None
        async with self.session.request(r.method, url, json=request.body, params=params, headers=headers) as response:
            records, _ = answer_records(getattr(response, "attempts", None), response.status, response.reason)
            text = await response.text(errors="replace")
            # no response on the reply: an aiohttp ClientResponse cannot be pickled, and errors travel pickled (Ray)
            return Reply(r.endpoint, response.status, text, records, None, polls)

    async def aclose(self) -> None:
        await self.session.close()


class _Httpx:
    def __init__(self, client: httpx.AsyncClient) -> None:
        import httpx

        self.client = client
        self.errors: tuple[type[BaseException], ...] = (httpx.HTTPError, TimeoutError, requests.RequestException, ResilienceError)

    async def send(self, request: Request, url: str, headers: Mapping[str, str] | None, polls: int) -> Reply:
        r = request.route
        params = request.params or None
        response = await self.client.request(r.method, url, json=request.body, params=params, headers=headers)
        records, _ = answer_records(response.extensions.get("attempts"), response.status_code, response.reason_phrase)
        return Reply(r.endpoint, response.status_code, response.text, records, response, polls)

    async def aclose(self) -> None:
        await self.client.aclose()


def sender_for(session: object) -> AsyncSender:
    """The sender for ``session``: an ``aiohttp.ClientSession`` or an ``httpx.AsyncClient``; anything else is a TypeError."""
    aiohttp_mod = sys.modules.get("aiohttp")
    if aiohttp_mod is not None and isinstance(session, aiohttp_mod.ClientSession):
        return _Aiohttp(session)
    httpx_mod = sys.modules.get("httpx")
    if httpx_mod is not None and isinstance(session, httpx_mod.AsyncClient):
        return _Httpx(session)
    kind = f"{type(session).__module__}.{type(session).__qualname__}"
    raise TypeError(f"AsyncVLLMClient session must be an aiohttp.ClientSession or an httpx.AsyncClient, but was a {kind}")
