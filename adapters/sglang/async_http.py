"""The request helper under ``AsyncSGLangClient``: one small interface, an aiohttp and an httpx implementation.

``requester_for(session)`` wraps an ``aiohttp.ClientSession`` or an
``httpx.AsyncClient``; both send a ``calls.Call`` and give back an
``Answer`` (status, text, attempts), or stream its lines. Nothing here decides
what an answer means. Neither aiohttp nor httpx is imported until a session of
that kind exists (or ``aiohttp_session`` builds one).
"""

from __future__ import annotations

import codecs
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

import requests

from resilience.adapters.sglang.calls import Answer, Call, answer_records
from resilience.errors import ResilienceError
from resilience.outcome import AttemptRecord

if TYPE_CHECKING:
    import aiohttp
    import httpx

__all__ = ["AsyncRequester", "StreamedReply", "aiohttp_session", "requester_for", "resilient_middleware"]


class StreamedReply(Protocol):
    """A response whose body is read as it arrives."""

    status: int
    attempts: int
    records: tuple[AttemptRecord, ...]
    """The call's delivery record (``calls.answer_records``)."""
    response: Any
    """The transport's response, put on errors as ``error.response``; None where it cannot be pickled (aiohttp)."""

    async def text(self) -> str:
        """The whole (remaining) body as text."""
        ...

    def lines(self) -> AsyncIterator[str]:
        """The body line by line, without line endings."""
        ...


class AsyncRequester(Protocol):
    """Sends one ``Call`` over an async HTTP session."""

    errors: tuple[type[BaseException], ...]
    """What a failed exchange raises (transport errors and the resilience layer's own), for ``health()``."""

    async def send(self, call: Call, url: str, headers: Mapping[str, str] | None) -> Answer:
        """Send ``call`` to ``url`` and read the whole answer."""
        ...

    def stream(self, call: Call, url: str, headers: Mapping[str, str] | None) -> AbstractAsyncContextManager[StreamedReply]:
        """Send ``call`` and read the answer as it arrives, within the ``async with`` block."""
        ...

    async def aclose(self) -> None:
        """Close the session."""
        ...


def _split_lines(buffer: str) -> tuple[list[str], str]:
    """Whole lines of ``buffer`` (``\\r\\n`` or ``\\n`` endings stripped) and what is left after the last newline."""
    *lines, rest = buffer.split("\n")
    return [line.rstrip("\r") for line in lines], rest


# -- aiohttp -----------------------------------------------------------------------------


class _AiohttpReply:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.response = None  # an aiohttp ClientResponse cannot be pickled, and errors travel pickled (Ray)
        self.status = response.status
        self.records, _ = answer_records(getattr(response, "attempts", None), response.status)
        self.attempts = len(self.records)

    async def text(self) -> str:
        return await self._response.text(errors="replace")

    async def lines(self) -> AsyncIterator[str]:
        # iter_any, not readline: one SSE chunk of a long generation can exceed aiohttp's line limit.
        # SSE is UTF-8 (WHATWG); the incremental decoder keeps a character split across chunks whole.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        rest = ""
        async for chunk in self._response.content.iter_any():
            lines, rest = _split_lines(rest + decoder.decode(chunk))
            for line in lines:
                yield line
        rest += decoder.decode(b"", final=True)
        if rest:
            yield rest.rstrip("\r")


class AiohttpRequester:
    """``AsyncRequester`` over an ``aiohttp.ClientSession`` (with or without ``ResilientMiddleware``)."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        import aiohttp

        self.session = session
        self.errors: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError, requests.RequestException, ResilienceError)

    async def send(self, call: Call, url: str, headers: Mapping[str, str] | None) -> Answer:
        async with self.session.request(call.method, url, json=call.body, params=call.params, headers=headers) as response:
            # what ``_AiohttpReply`` reads, without building one: no response on the answer (it cannot be pickled)
            records, confirmed = answer_records(getattr(response, "attempts", None), response.status, response.reason)
            text = await response.text(errors="replace")
            return Answer(call.endpoint, response.status, text, len(records), None, records, confirmed)

    @asynccontextmanager
    async def _stream(self, call: Call, url: str, headers: Mapping[str, str] | None) -> AsyncIterator[StreamedReply]:
        async with self.session.request(call.method, url, json=call.body, params=call.params, headers=headers) as response:
            yield _AiohttpReply(response)

    def stream(self, call: Call, url: str, headers: Mapping[str, str] | None) -> AbstractAsyncContextManager[StreamedReply]:
        return self._stream(call, url, headers)

    async def aclose(self) -> None:
        await self.session.close()


def resilient_middleware(middleware_kwargs: Mapping[str, Any]) -> Any:
    """``ResilientMiddleware(**middleware_kwargs)``; a clear ImportError without aiohttp."""
    try:
        from resilience.adapters.aiohttp import ResilientMiddleware
    except ImportError as exc:
        raise ImportError(
            "AsyncSGLangClient's default transport needs aiohttp: pip install 'controlplane-resilience[aiohttp]' "
            "(or pass session=httpx.AsyncClient(transport=AsyncResilientTransport(...)))"
        ) from exc
    return ResilientMiddleware(**middleware_kwargs)


def aiohttp_session(middleware: Any, *, limit_per_host: int) -> aiohttp.ClientSession:
    """A new ``aiohttp.ClientSession`` with ``middleware`` and a pool of ``limit_per_host`` connections.

    No session-wide timeout: each attempt is bounded by its endpoint policy's
    ``attempt_timeout_s`` and each call by its ``deadline_s`` (and any ``Deadline``
    in context). Must be called inside the event loop that will use it.
    """
    import aiohttp

    connector = aiohttp.TCPConnector(limit=limit_per_host, limit_per_host=limit_per_host)
    return aiohttp.ClientSession(connector=connector, middlewares=(middleware,), timeout=aiohttp.ClientTimeout(total=None))


# -- httpx --------------------------------------------------------------------------------


class _HttpxReply:
    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status = response.status_code
        self.records, self.confirmed = answer_records(response.extensions.get("attempts"), response.status_code, response.reason_phrase)
        self.attempts = len(self.records)

    async def text(self) -> str:
        await self.response.aread()
        return self.response.text

    async def lines(self) -> AsyncIterator[str]:
        async for line in self.response.aiter_lines():
            yield line.rstrip("\r\n")


class HttpxRequester:
    """``AsyncRequester`` over an ``httpx.AsyncClient`` (with or without ``AsyncResilientTransport``)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        import httpx

        self.client = client
        self.errors: tuple[type[BaseException], ...] = (httpx.HTTPError, TimeoutError, requests.RequestException, ResilienceError)

    async def send(self, call: Call, url: str, headers: Mapping[str, str] | None) -> Answer:
        response = await self.client.request(call.method, url, json=call.body, params=call.params, headers=headers)
        reply = _HttpxReply(response)
        return Answer(call.endpoint, reply.status, await reply.text(), reply.attempts, response, reply.records, reply.confirmed)

    @asynccontextmanager
    async def _stream(self, call: Call, url: str, headers: Mapping[str, str] | None) -> AsyncIterator[StreamedReply]:
        async with self.client.stream(call.method, url, json=call.body, params=call.params, headers=headers) as response:
            yield _HttpxReply(response)

    def stream(self, call: Call, url: str, headers: Mapping[str, str] | None) -> AbstractAsyncContextManager[StreamedReply]:
        return self._stream(call, url, headers)

    async def aclose(self) -> None:
        await self.client.aclose()


def requester_for(session: object) -> AsyncRequester:
    """The helper for ``session``: an ``aiohttp.ClientSession`` or an ``httpx.AsyncClient``; anything else is a TypeError."""
    aiohttp_mod = sys.modules.get("aiohttp")
    if aiohttp_mod is not None and isinstance(session, aiohttp_mod.ClientSession):
        return AiohttpRequester(session)
    httpx_mod = sys.modules.get("httpx")
    if httpx_mod is not None and isinstance(session, httpx_mod.AsyncClient):
        return HttpxRequester(session)
    kind = f"{type(session).__module__}.{type(session).__qualname__}"
    raise TypeError(f"AsyncSGLangClient session must be an aiohttp.ClientSession or an httpx.AsyncClient, but was a {kind}")
