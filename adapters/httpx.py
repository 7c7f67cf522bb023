"""``ResilientTransport`` / ``AsyncResilientTransport``: the retry loop as an httpx transport.

Mount it like any transport::

    client = httpx.Client(transport=ResilientTransport(policies))
    client = httpx.AsyncClient(mounts={"http://127.0.0.1:30000": AsyncResilientTransport(policies)})

Each ``handle_request`` / ``handle_async_request`` is one logical call of the
retry core (``Retrier.run`` / ``Retrier.arun``): the same rules as the
requests adapter (deadlines, breaker, retry budget, ambiguity, probes,
events). The wrapped transport (default ``httpx.HTTPTransport()`` /
``httpx.AsyncHTTPTransport()``) makes each attempt; its own retries should
stay off (``retries=0``, its default).

- **Timeouts.** The caller's ``timeout=`` (the request's ``timeout``
  extension) is the caller's own (connect, read) timeout for the core's one
  precedence rule (``resilience.retry.spec.attempt_timeouts``). Each attempt gets
  the (connect, read) the core chose; its write timeout never exceeds that
  read timeout nor its pool timeout that connect timeout (the caller's
  smaller values are kept), so a deadline bounds every phase of an attempt.
- **Bodies** (only an ``httpx.ByteStream`` is sent again) and the attempts on
  ``response.extensions``: ``docs/http-clients.md``. A response that will not
  be returned is read and closed before the next attempt.
- **Errors** are httpx exceptions (``resilience.adapters.httpx_errors``). When the
  retries end on a transport error (a refusal past the deadline, say), the
  transport's own error is raised, with ``.attempts``; so is an error raised
  unretried (``resilience.outcome.attempts_of`` reads the record).
- **Data requests wait in a queue of ours**: ``DataQueue`` (async: one let
  in per loop turn) or ``SyncDataQueue`` (``adapters/data_queue.py``), in
  front of the wrapped ``httpx.AsyncHTTPTransport``'s or
  ``httpx.HTTPTransport``'s pool, so that httpcore's own queue stays short
  (its pool walks that queue on every request start and end); control routes
  take the lane and never wait there.
"""

from __future__ import annotations

import functools
import math
import ssl
from collections.abc import Callable, Coroutine, Mapping
from types import TracebackType
from typing import Any, Unpack

import httpx

from resilience.adapters.control_lane import routed
from resilience.adapters.control_pools import async_httpx_lane, httpx_lane
from resilience.adapters.data_queue import DataQueue, SyncDataQueue
from resilience.adapters.driver_config import UNSET, ConfigViews, DriverConfig, DriverKeywords, Unset, driver_config
from resilience.adapters.httpx_errors import ERROR_TYPES
from resilience.adapters.routing import RouteCache, route_of
from resilience.errors import ConfigError, require
from resilience.outcome import AttemptRecord, Delivery
from resilience.policy import PolicyTable
from resilience.retry.spec import AttemptResult, CallSpec, Timeouts, responded

__all__ = ["AsyncResilientTransport", "ResilientTransport", "caller_timeout", "transport_failure"]

_NOT_TRANSIENT = (httpx.UnsupportedProtocol, httpx.LocalProtocolError)
"""Errors a retry cannot fix: a URL without ``http(s)://``, a request h11 refuses to write (bad header)."""


def transport_failure(exc: httpx.TransportError) -> tuple[Delivery, str]:
    """Did a failed attempt surely never reach the server? And a bounded name for it.

    httpcore raises ``ConnectError`` / ``ConnectTimeout`` only while opening a
    connection (TCP connect, refused or unreachable, or the TLS handshake),
    ``PoolTimeout`` while waiting for one, and ``ProxyError`` when the proxy
    refused the tunnel (CONNECT answered non-2xx, a SOCKS handshake): none of
    them has written a byte of the request. A write or read failure on an open
    connection (``WriteError``, ``ReadError``, ``RemoteProtocolError``
    "Server disconnected without sending a response", a read or write
    timeout) may come after the server got the request: httpcore does not
    tell a reset before the request's first byte from one after it.
    """
    if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
        return Delivery.NOT_SENT, "connect_timeout"
    if isinstance(exc, (httpx.ConnectError, httpx.ProxyError)):
        return Delivery.NOT_SENT, "connect_error"
    if isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout)):
        return Delivery.AMBIGUOUS, "read_timeout"
    if isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)):
        return Delivery.AMBIGUOUS, "connection_reset"
    return Delivery.AMBIGUOUS, "error"


def _not_transient(exc: httpx.TransportError) -> bool:
    """Re-raised unretried: a bad URL or header, or a certificate that failed verification (a ``ConnectError`` by its cause)."""
    if isinstance(exc, _NOT_TRANSIENT):
        return True
    cause: BaseException | None = exc
    for _ in range(8):  # httpx error <- httpcore error <- ssl error
        if cause is None:
            return False
        if isinstance(cause, ssl.SSLCertVerificationError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _never_sent_unretried(exc: BaseException) -> bool:
    """For an error raised unretried: a URL without ``http(s)://`` (nothing opened) or a ``ConnectError`` (the TLS handshake).

    A ``LocalProtocolError`` may come while the body is written, after the headers: no proof.
    """
    return isinstance(exc, (httpx.UnsupportedProtocol, httpx.ConnectError))


def _seconds(timeout: Mapping[str, object], key: str) -> float | None:
    value = timeout.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"request.extensions['timeout'][{key!r}] must be a number of seconds >= 0 or None, but was {value!r}")
    return float(value)


def caller_timeout(request: httpx.Request) -> Timeouts | None:
    """The caller's (connect, read) seconds from the request's ``timeout`` extension; None when it has none.

    ``httpx.Client`` always sets one (its ``timeout=``, default 5 s); a
    request built by hand and handed to the transport may have none, and then
    the policy's ``attempt_timeout_s`` applies.
    """
    try:
        raw = request.extensions["timeout"]
    except KeyError:
        return None
    if raw is None:
        return None
    if type(raw) is dict:  # the usual case, ``httpx.Timeout.as_dict()``: two floats >= 0 need no other check
        try:
            connect, read = raw["connect"], raw["read"]
        except KeyError:
            pass
        else:
            if type(connect) is float and type(read) is float and connect >= 0 and read >= 0:
                return connect, read
    if not isinstance(raw, Mapping):
        raise ConfigError(f"request.extensions['timeout'] must be a dict of connect/read/write/pool seconds, but was {raw!r}")
    return _seconds(raw, "connect"), _seconds(raw, "read")


def _at_most(value: object, bound: float | None) -> float | None:
    if type(value) is float and type(bound) is float:  # the usual case: httpx.Client sets every phase
        smallest = bound if bound < value else value
        return None if math.isinf(smallest) else smallest
    own = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    smallest = min(math.inf if own is None else float(own), math.inf if bound is None else bound)
    return None if math.isinf(smallest) else smallest


def _send(handle: Callable[[httpx.Request], Any], request: httpx.Request, n: int, timeouts: Timeouts, carrier: Mapping[str, str]) -> Any:
    """Attempt ``n``: ``handle`` (the wrapped transport's ``handle_request`` or ``handle_async_request``) called with its request.

    When the core's timeouts are the caller's own and no header is added, the
    caller's request itself (nothing to copy). Else a shallow copy of ``request``
    (``httpx.Request.__init__`` would rebuild the URL, headers and stream: about
    6 us a call), same body stream, with its own ``extensions`` dict holding the
    core's timeouts, and its own headers, the carrier's set, only when the
    carrier adds some; the caller's request keeps its own extensions and headers.
    """
    connect, read = timeouts
    try:
        own = request.extensions["timeout"]
    except KeyError:
        own = None
    if not carrier and type(own) is dict and type(connect) is float and type(read) is float and connect < math.inf and read < math.inf:
        try:  # the usual case: the attempt's timeouts are the caller's own, every phase set (``httpx.Timeout.as_dict()``)
            same = own["connect"] == connect and own["read"] == read and own["write"] <= read and own["pool"] <= connect
        except (KeyError, TypeError):
            same = False
        if same:
            return handle(request)
    write = pool = None
    if isinstance(own, Mapping):
        write, pool = own.get("write"), own.get("pool")
    write, pool = _at_most(write, read), _at_most(pool, connect)
    if not carrier and own == {"connect": connect, "read": read, "write": write, "pool": pool}:
        return handle(request)  # the caller's own timeouts are the attempt's (the usual case): send its request, as a bare transport would
    attempt = _new_request(httpx.Request)
    attempt.__dict__.update(request.__dict__)
    attempt.extensions = {**request.extensions, "timeout": {"connect": connect, "read": read, "write": write, "pool": pool}}
    if carrier:
        attempt.headers = request.headers.copy()
        attempt.headers.update(carrier)
    return handle(attempt)


_new_request = httpx.Request.__new__
_PARSED_SAMPLE = getattr(httpx.URL("http://h:1/p"), "_uri_reference", None)
_PARSED = _PARSED_SAMPLE is not None and all(hasattr(_PARSED_SAMPLE, part) for part in ("scheme", "host", "port", "path"))
"""httpx (0.23 to 0.28 at least) keeps a URL's parts parsed (``URL._uri_reference``): the route key reads them. Else ``str(url)``."""


def _report(response: httpx.Response) -> AttemptResult[httpx.Response]:
    return responded(response, response.status_code, response.headers)


def _held(hold: Callable[[httpx.Response], object], response: httpx.Response) -> AttemptResult[httpx.Response]:
    """``_report`` for a response that holds a ``DataQueue`` slot: ``hold`` (the queue's) lets it keep the slot until closed."""
    hold(response)
    return responded(response, response.status_code, response.headers)


def _failed(exc: BaseException) -> AttemptResult[httpx.Response]:
    """A transport error as the attempt's result; any other error, and one a retry cannot fix, re-raised."""
    if not isinstance(exc, httpx.TransportError) or _not_transient(exc):
        raise exc
    delivery, kind = transport_failure(exc)
    return AttemptResult(error=exc, delivery=delivery, error_kind=kind)


def _slot_failed(queue_failed: Callable[[BaseException], None], exc: BaseException) -> AttemptResult[httpx.Response]:
    """``_failed`` for an attempt that entered a ``DataQueue``: ``queue_failed`` (the queue's) gives its slot back first."""
    queue_failed(exc)
    return _failed(exc)


def _discard(response: httpx.Response) -> None:
    """Read (so the connection goes back to the pool) and close a response that will not be returned."""
    try:
        response.read()
    except (httpx.HTTPError, httpx.StreamError, OSError):
        pass
    finally:
        response.close()


async def _adiscard(response: httpx.Response) -> None:
    """``_discard`` for an async response."""
    try:
        await response.aread()
    except (httpx.HTTPError, httpx.StreamError, OSError):
        pass
    finally:
        await response.aclose()


_Sending = tuple[
    Callable[[httpx.Request], Any],
    Callable[[httpx.Response], AttemptResult[httpx.Response]],
    Callable[[BaseException], AttemptResult[httpx.Response]],
]
"""What an attempt goes through: (send the request, report its response, read its error) (``_Resilient._sending``)."""


class _Resilient(ConfigViews):
    """What both transports share: the configuration, the retry core, and turning a request into a ``CallSpec``."""

    def __init__(self, config: DriverConfig) -> None:
        self.driver_config = config
        self.retrier = config.retrier(ERROR_TYPES)
        self._routes = RouteCache(config.policies, routed(config.control_lane, route_of))

    def _spec(self, request: httpx.Request) -> tuple[CallSpec, bool]:
        """The call's ``CallSpec``, and whether its route takes the control lane."""
        url = request.url
        method = request.method
        if _PARSED:  # the key from httpx's parsed URL (a named tuple of str/int): no ``str(url)`` on a hit
            parts = url._uri_reference
            key: tuple[object, ...] = (method, parts.scheme, parts.host, parts.port, parts.path)
        else:
            key = (method, str(url).partition("?")[0])
        try:
            method, match, engine, host, port, on_lane = self._routes.routes[key]
        except KeyError:
            method, match, engine, host, port, on_lane = self._routes.add(key, method, str(url))  # str(httpx.URL) is percent-encoded
        stream = request.stream
        replayable = type(stream) is httpx.ByteStream or isinstance(stream, httpx.ByteStream)
        return CallSpec(
            method, url, match, engine, host, port,
            request_timeout=caller_timeout(request),
            request=request,
            replayable=replayable,
            body=request.content if replayable and match.probe is not None else None,  # only probes read it; no I/O
        ), on_lane

    def _sending(self, data: _Sending, lane: Callable[[httpx.Request], Any] | None) -> None:
        """Fix, once, what an attempt goes through and how its result is read: ``data`` (the queue's ``enter``, ``hold`` and
        ``failed`` hooks, else the transport's send with ``_report`` and ``_failed``) on a data route, ``lane`` (the lane's
        transport; None: ``data``) on a control route."""
        self._data = data
        self._lane = data if lane is None else (lane, _report, _failed)

    @staticmethod
    def _probe_done(request: httpx.Request) -> httpx.Response:
        """The response for "a probe confirmed the ambiguous call was applied": a 200 with an empty body."""
        return httpx.Response(200, request=request, extensions={"reason_phrase": b"Applied (confirmed by probe)"})


class ResilientTransport(_Resilient, httpx.BaseTransport):
    """An ``httpx.BaseTransport`` that runs the resilience retry loop around a wrapped transport.

    ``transport``: the transport that makes each attempt (default
    ``httpx.HTTPTransport()``; pass one to set TLS, limits, a proxy).
    Requests for it wait for its pool in ``SyncDataQueue`` (``.queue``), at
    most ``max_connections`` inside it at once; control routes take the lane
    (``.lane``) and never wait there.
    ``config``: a ``DriverConfig`` (kept as ``.driver_config``) shared with other drivers (its breakers and
    budgets per engine included). Or, instead, its fields as keywords
    (``policies`` and ``DriverKeywords``, each with the field's meaning and
    default); ``config`` with any of them raises ``ConfigConflict``.
    """

    def __init__(
        self,
        policies: PolicyTable | Unset | None = UNSET,
        *,
        transport: httpx.BaseTransport | None = None,
        config: DriverConfig | None = None,
        **keywords: Unpack[DriverKeywords],
    ) -> None:
        require(
            transport is None or isinstance(transport, httpx.BaseTransport),
            "ResilientTransport",
            "transport",
            "an httpx.BaseTransport (for an async one use AsyncResilientTransport)",
            transport,
        )
        config = driver_config("ResilientTransport", config, policies=policies, **keywords)
        super().__init__(config)
        self.transport = transport if transport is not None else httpx.HTTPTransport()
        self.lane = httpx_lane(self.transport, config.control_lane)
        """The transport control routes take (``adapters/control_lane.py``); None: everything takes ``transport``."""
        self.queue = SyncDataQueue.of(self.transport)
        """Where requests for ``transport`` wait for its pool (``SyncDataQueue``); None: they go straight to it."""
        queue, lane = self.queue, self.lane
        data: _Sending = (self.transport.handle_request if queue is None else queue.send, _report, _failed)
        self._sending(data, None if lane is None else lane.handle_request)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` with the retry loop; the contract of ``httpx.BaseTransport.handle_request``."""
        spec, on_lane = self._spec(request)
        send, report, failed = self._lane if on_lane else self._data
        response, records = self.retrier.run(
            spec,
            functools.partial(_send, send, request),
            report=report,
            failed=failed,
            discard=_discard,
            on_probe_done=lambda: self._probe_done(request),
            never_sent=_never_sent_unretried,
        )
        extensions = response.extensions
        extensions["attempts"] = records
        extensions["endpoint"] = spec.match.endpoint
        return response

    def close(self) -> None:
        """Close the wrapped transport (``httpx.Client.close()`` calls it)."""
        self.transport.close()

    def __enter__(self) -> ResilientTransport:
        self.transport.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        self.transport.__exit__(exc_type, exc_value, traceback)


class AsyncResilientTransport(_Resilient, httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` that runs the resilience retry loop around a wrapped async transport.

    The same arguments as ``ResilientTransport``; ``transport`` defaults to
    ``httpx.AsyncHTTPTransport()``. Backoff waits are ``asyncio.sleep``; a
    cancelled calling task ends the call without sending anything more and
    gives its breaker slot back. Requests for ``transport`` wait for its pool
    in ``DataQueue`` (``.queue``), at most ``max_connections`` inside it at
    once and one let in per turn of the event loop; control routes take the
    lane (``.lane``) and never wait there.
    """

    def __init__(
        self,
        policies: PolicyTable | Unset | None = UNSET,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        config: DriverConfig | None = None,
        **keywords: Unpack[DriverKeywords],
    ) -> None:
        require(
            transport is None or isinstance(transport, httpx.AsyncBaseTransport),
            "AsyncResilientTransport",
            "transport",
            "an httpx.AsyncBaseTransport (for a sync one use ResilientTransport)",
            transport,
        )
        config = driver_config("AsyncResilientTransport", config, policies=policies, **keywords)
        super().__init__(config)
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()
        self.lane = async_httpx_lane(self.transport, config.control_lane)
        """The transport control routes take (``adapters/control_lane.py``); None: everything takes ``transport``."""
        self.queue = DataQueue.of(self.transport)
        """Where requests for ``transport`` wait for its pool (``DataQueue``); None: they go straight to it."""
        queue, lane = self.queue, self.lane
        data: _Sending = (
            (self.transport.handle_async_request, _report, _failed)
            if queue is None
            else (queue.enter, functools.partial(_held, queue.hold), functools.partial(_slot_failed, queue.failed))
        )
        self._sending(data, None if lane is None else lane.handle_async_request)

    def handle_async_request(self, request: httpx.Request) -> Coroutine[Any, Any, httpx.Response]:
        """Send ``request`` with the retry loop; the contract of ``httpx.AsyncBaseTransport.handle_async_request``.

        A plain function returning ``Retrier.arun``'s coroutine (awaited by
        httpx as its own ``async def`` would be): the wrapped transport's
        coroutine runs under that one frame of ours, and ``DataQueue.send``'s
        for a request off the lane when there is a queue.
        """
        spec, on_lane = self._spec(request)
        send, report, failed = self._lane if on_lane else self._data

        def finish(response: httpx.Response, records: tuple[AttemptRecord, ...]) -> httpx.Response:
            extensions = response.extensions
            extensions["attempts"] = records
            extensions["endpoint"] = spec.match.endpoint
            return response

        return self.retrier.arun(
            spec,
            functools.partial(_send, send, request),
            report=report,
            failed=failed,
            discard=_adiscard,
            on_probe_done=lambda: self._probe_done(request),
            never_sent=_never_sent_unretried,
            finish=finish,
        )

    async def aclose(self) -> None:
        """Close the wrapped transport (``httpx.AsyncClient.aclose()`` calls it)."""
        await self.transport.aclose()

    async def __aenter__(self) -> AsyncResilientTransport:
        await self.transport.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        await self.transport.__aexit__(exc_type, exc_value, traceback)
