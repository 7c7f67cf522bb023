"""How both engine kinds' clients send a request and read the answer (what an answer means is each kind's ``calls.py``).

``Answer`` (what an engine answered, with the transport's delivery record); ``answer_of`` (a sync client's, from a
``requests.Response``); ``AsyncRequester`` (``requester_for``: the async clients' one sender, over an
``aiohttp.ClientSession`` or an ``httpx.AsyncClient``); ``OwnAsyncSession`` and ``AsyncSessionOwner`` (an async
client's session: the one passed, or its own aiohttp one opened in the running loop). Neither aiohttp nor httpx is
imported until a session of that kind exists.
"""

from __future__ import annotations

import asyncio
import codecs
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

import requests

from resilience.errors import ResilienceError
from resilience.outcome import AttemptRecord, Delivery, Outcome

if TYPE_CHECKING:
    import aiohttp
    import httpx

__all__ = [
    "DEFAULT_LIMIT_PER_HOST", "PROBE_CONFIRMED_REASON", "Answer", "AsyncRequester", "AsyncSessionOwner", "Outgoing", "OwnAsyncSession",
    "StreamedReply", "answer_of", "answer_records", "requester_for",
]

DEFAULT_LIMIT_PER_HOST = 100
"""Connections an async client's own session keeps open to its engine at most (aiohttp's default total limit)."""

PROBE_CONFIRMED_REASON = "Applied (confirmed by probe)"
"""The reason phrase of the body-less 200 every driver returns when a probe proved a lost call applied."""

Params = Mapping[str, str] | tuple[tuple[str, str], ...] | None
"""Query parameters: a mapping, or pairs (a key may repeat: ``/wake_up?tags=weights&tags=kv_cache``)."""


class Outgoing(Protocol):
    """One request, as both kinds build it (SGLang's ``Call``, vLLM's ``Request``)."""

    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def body(self) -> dict[str, Any] | None: ...
    @property
    def params(self) -> Params: ...
    @property
    def endpoint(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Answer:
    """What the engine answered: ``status``, the body as ``text``, and the transport's delivery ``records``.

    ``response``: the transport's own response object, put on raised errors as ``error.response`` (None = none, as over
    aiohttp, whose response cannot be pickled); never read by the parsers. ``confirmed_by_probe``: the engine's own
    answer was lost and the transport's memory probe proved the call applied. ``polls``: which ask this is, for a call
    asked again after a refusal (1 = the first).
    """

    endpoint: str
    status: int
    text: str
    records: tuple[AttemptRecord, ...] = ()
    response: Any = None
    confirmed_by_probe: bool = False
    polls: int = 1

    @property
    def attempts(self) -> int:
        """Attempts the call took (at least 1: an answer came)."""
        return max(1, len(self.records))

    @property
    def ok(self) -> bool:
        """True for a status below 400 (``requests.Response.ok``)."""
        return self.status < 400


def answer_records(value: object, status: int, reason: str | None = None) -> tuple[tuple[AttemptRecord, ...], bool]:
    """The delivery record of an answer, and whether a memory probe confirmed it: ``(records, confirmed_by_probe)``.

    ``value``: what the transport put on its response (``.attempts``, httpx's ``extensions["attempts"]``); ``status`` /
    ``reason``: the response's status and reason phrase (None = not known). The records are the transport's (a non-empty
    tuple of ``AttemptRecord``), else one attempt that got ``status``: a session without the resilience layer records
    nothing, and the answer itself proves that one attempt reached the engine and was answered. ``confirmed_by_probe``
    is True only for the layer's own "applied" answer: a 200 with ``PROBE_CONFIRMED_REASON`` that carries the layer's
    record (an engine or proxy answering that phrase itself is not believed).
    """
    if isinstance(value, tuple) and value and all([isinstance(r, AttemptRecord) for r in value]):  # a list: no generator to resume
        return value, status == 200 and reason == PROBE_CONFIRMED_REASON
    outcome = Outcome.SUCCESS if status < 400 else Outcome.FATAL
    return (AttemptRecord(0, status, outcome, Delivery.RESPONDED, None, 0.0),), False


def answer_of(endpoint: str, response: requests.Response) -> Answer:
    """What ``response`` answered to the call on ``endpoint`` (reads the body)."""
    records, confirmed = answer_records(getattr(response, "attempts", None), response.status_code, response.reason)
    return Answer(endpoint, response.status_code, response.text, records, response, confirmed)


def _pairs(params: Params) -> Any:
    """``params`` as both libraries take them: pairs as a list, a mapping as is, None for none."""
    return list(params) if isinstance(params, tuple) else (params or None)


class StreamedReply(Protocol):
    """A response whose body is read as it arrives."""

    status: int
    records: tuple[AttemptRecord, ...]
    """The call's delivery record (``answer_records``)."""
    response: Any
    """The transport's response, put on errors as ``error.response``; None where it cannot be pickled (aiohttp)."""

    async def text(self) -> str:
        """The whole (remaining) body as text."""
        ...

    def lines(self) -> AsyncIterator[str]:
        """The body line by line, without line endings."""
        ...


class AsyncRequester(Protocol):
    """Sends one request over an async HTTP session."""

    errors: tuple[type[BaseException], ...]
    """What a failed exchange raises (transport errors and the resilience layer's own), for ``health()``."""

    @property
    def session(self) -> Any:
        """The ``aiohttp.ClientSession`` or ``httpx.AsyncClient`` it sends over."""
        ...

    async def send(self, call: Outgoing, url: str, headers: Mapping[str, str] | None) -> Answer:
        """Send ``call`` to ``url`` and read the whole answer."""
        ...

    def stream(self, call: Outgoing, url: str, headers: Mapping[str, str] | None) -> AbstractAsyncContextManager[StreamedReply]:
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

    async def send(self, call: Outgoing, url: str, headers: Mapping[str, str] | None) -> Answer:
        async with self.session.request(call.method, url, json=call.body, params=_pairs(call.params), headers=headers) as response:
            # no response on the answer: an aiohttp ClientResponse cannot be pickled, and errors travel pickled (Ray)
            records, confirmed = answer_records(getattr(response, "attempts", None), response.status, response.reason)
            text = await response.text(errors="replace")
            return Answer(call.endpoint, response.status, text, records, None, confirmed)

    @asynccontextmanager
    async def stream(self, call: Outgoing, url: str, headers: Mapping[str, str] | None) -> AsyncIterator[StreamedReply]:
        async with self.session.request(call.method, url, json=call.body, params=_pairs(call.params), headers=headers) as response:
            yield _AiohttpReply(response)

    async def aclose(self) -> None:
        await self.session.close()


def resilient_middleware(middleware_kwargs: Mapping[str, Any], owner: str) -> Any:
    """``ResilientMiddleware(**middleware_kwargs)``; a clear ImportError naming ``owner`` without aiohttp."""
    try:
        from resilience.adapters.aiohttp import ResilientMiddleware
    except ImportError as exc:
        raise ImportError(
            f"{owner}'s default transport needs aiohttp: pip install 'controlplane-resilience[aiohttp]' "
            "(or pass session=httpx.AsyncClient(transport=AsyncResilientTransport(...)))"
        ) from exc
    return ResilientMiddleware(**middleware_kwargs)


def aiohttp_session(middleware: Any, *, limit_per_host: int) -> aiohttp.ClientSession:
    """A new ``aiohttp.ClientSession`` with ``middleware`` and a pool of ``limit_per_host`` connections.

    No session-wide timeout: each attempt is bounded by its endpoint policy's ``attempt_timeout_s`` and each call by its
    ``deadline_s`` (and any ``Deadline`` in context). Must be called inside the event loop that will use it.
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

        self.session = client
        self.errors: tuple[type[BaseException], ...] = (httpx.HTTPError, TimeoutError, requests.RequestException, ResilienceError)

    async def send(self, call: Outgoing, url: str, headers: Mapping[str, str] | None) -> Answer:
        response = await self.session.request(call.method, url, json=call.body, params=_pairs(call.params), headers=headers)
        reply = _HttpxReply(response)
        return Answer(call.endpoint, reply.status, await reply.text(), reply.records, response, reply.confirmed)

    @asynccontextmanager
    async def stream(self, call: Outgoing, url: str, headers: Mapping[str, str] | None) -> AsyncIterator[StreamedReply]:
        async with self.session.stream(call.method, url, json=call.body, params=_pairs(call.params), headers=headers) as response:
            yield _HttpxReply(response)

    async def aclose(self) -> None:
        await self.session.aclose()


def requester_for(session: object, owner: str) -> AsyncRequester:
    """The sender for ``session``: an ``aiohttp.ClientSession`` or an ``httpx.AsyncClient``; else a TypeError naming ``owner``."""
    aiohttp_mod = sys.modules.get("aiohttp")
    if aiohttp_mod is not None and isinstance(session, aiohttp_mod.ClientSession):
        return AiohttpRequester(session)
    httpx_mod = sys.modules.get("httpx")
    if httpx_mod is not None and isinstance(session, httpx_mod.AsyncClient):
        return HttpxRequester(session)
    kind = f"{type(session).__module__}.{type(session).__qualname__}"
    raise TypeError(f"{owner} session must be an aiohttp.ClientSession or an httpx.AsyncClient, but was a {kind}")


# -- an async client's session -------------------------------------------------------------


class OwnAsyncSession:
    """An async client's session: the one passed (used as is, never closed), or its own, opened in the running loop.

    ``owner``: the client's class name, for errors. ``session``: an ``aiohttp.ClientSession`` or ``httpx.AsyncClient``
    (None = the client's own aiohttp session with one ``ResilientMiddleware(**middleware_kwargs)``, built here, whose
    breakers and budgets outlive ``aclose()``). ``limit_per_host``: the own session's pool size (an int >= 1). The own
    session belongs to the loop that opened it: a call from another loop while that one is open raises RuntimeError;
    once that loop is closed, a new session is opened.
    """

    def __init__(self, owner: str, session: object | None, middleware_kwargs: Mapping[str, Any], limit_per_host: int) -> None:
        if isinstance(limit_per_host, bool) or not isinstance(limit_per_host, int) or limit_per_host < 1:
            raise ValueError(f"{owner} limit_per_host must be an int >= 1, but was {limit_per_host!r}")
        self.owner = owner
        self.owned = session is None
        self._requester: AsyncRequester | None = None if session is None else requester_for(session, owner)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._limit_per_host = limit_per_host
        self._middleware_kwargs = dict(middleware_kwargs)
        self.middleware: Any = None if session is not None else resilient_middleware(self._middleware_kwargs, owner)
        """The own session's ``ResilientMiddleware`` (None with a session passed)."""

    @property
    def session(self) -> Any:
        """The session in use: the one passed, the own one once opened, else None."""
        return None if self._requester is None else self._requester.session

    def requester(self, client: object) -> AsyncRequester:
        """The sender; the own session is opened here, in the running loop (``client``: named in the loop error)."""
        loop = asyncio.get_running_loop()
        if self._requester is not None and self.owned and self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError(
                    f"{client!r} opened its session in another event loop, which is still open; an aiohttp session belongs "
                    "to one loop: await client.aclose() in that loop first, or use one client per loop"
                )
            self._requester = None  # the loop that opened it is closed, and its connections with it
        if self._requester is None:
            self._requester = requester_for(aiohttp_session(self.middleware, limit_per_host=self._limit_per_host), self.owner)
            self._loop = loop
        return self._requester

    async def aclose(self) -> None:
        """Close the own session (a session passed stays open); the next call opens a new one."""
        requester = self._requester
        if requester is not None and self.owned:
            self._requester, self._loop = None, None
            await requester.aclose()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the session (an open session cannot travel); an unpickled client opens its own."""
        if not self.owned:
            raise TypeError(f"an {self.owner} with a session you passed cannot be pickled; pass none to let it open its own")
        return {**self.__dict__, "_requester": None, "_loop": None, "middleware": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the middleware (fresh breakers and budgets) after unpickling."""
        self.__dict__.update(state)
        self.middleware = resilient_middleware(self._middleware_kwargs, self.owner)


class AsyncSessionOwner:
    """An async client's ``session``, ``aclose()`` and ``async with``, over its ``OwnAsyncSession`` (``_own``)."""

    _own: OwnAsyncSession

    @property
    def session(self) -> aiohttp.ClientSession | httpx.AsyncClient | None:
        """The session in use: the one passed, the client's own once opened, else None."""
        session: aiohttp.ClientSession | httpx.AsyncClient | None = self._own.session
        return session

    async def aclose(self) -> None:
        """Close the client's own session (a session you passed stays open). The next call opens a new one."""
        await self._own.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def _http(self) -> AsyncRequester:
        """The sender; the client's own session is opened here, in the running loop."""
        return self._own.requester(self)
