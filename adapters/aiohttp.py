"""``ResilientMiddleware``: the retry loop as an aiohttp client middleware (aiohttp 3.12 to 3.14).

Importing it checks the aiohttp internals it reads (``_aiohttp_compat``): an
aiohttp without client middlewares, or one whose internals differ, raises
``ImportError`` naming its version; a newer one with the same internals runs,
with a ``RuntimeWarning``.

Mount it on a session::

    session = aiohttp.ClientSession(middlewares=(ResilientMiddleware(policies),))

Each request through the session is one logical call of the core
(``Retrier.arun``): the middleware calls aiohttp's ``handler(request)`` once per
attempt, so everything aiohttp does per request (cookies, redirects, auth,
``raise_for_status``, trace configs) stays aiohttp's. Redirects are followed
outside the middleware: each hop is its own logical call.

Timeouts, bodies, errors, the probe's response, cancellation and aiohttp's
own re-run of a request are described in ``docs/http-clients.md`` (its
aiohttp section; here: ``caller_timeout``, ``_Attempts``,
``_replayable``, ``_probe_response``, ``_GIVEN_UP``). Besides:

- **Delivery.** ``ClientConnectorError`` (refused, DNS) and a connect timeout
  never reached the server (``NOT_SENT``); a read timeout, a disconnect, an
  ``OSError`` or a broken payload after sending may have been applied
  (``AMBIGUOUS``). ``InvalidURL``, TLS and fingerprint errors are raised
  at once, never retried, and recorded as not sent: aiohttp raises them
  before the request is written (the URL is checked first; TLS and a pinned
  fingerprint are checked by the connector while it opens the connection).
  A full pool (``TCPConnector(limit=...)``) waits within the connect limit and
  then fails as a connect timeout: not sent.
- **Results.** The attempts a call took are on the response as
  ``response.attempts`` (aiohttp's ``ClientResponse`` has no extensions dict)
  and on raised errors as ``error.attempts`` (``resilience.outcome.attempts_of``
  reads either).
- **A session closed during a backoff** ends the call with aiohttp's
  ``RuntimeError("Session is closed")``.
"""

from __future__ import annotations

import asyncio
import functools
import math
import operator
import time
import weakref
from collections.abc import MutableMapping
from contextvars import ContextVar
from types import CodeType
from typing import TYPE_CHECKING, Any, Unpack, cast

import aiohttp
from aiohttp import ClientRequest, ClientResponse, ClientTimeout
from aiohttp.client import DEFAULT_TIMEOUT, IDEMPOTENT_METHODS
from aiohttp.connector import Connection
from aiohttp.payload import BytesPayload, IOBasePayload
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from resilience.adapters import aiohttp_errors as errors
from resilience.adapters._aiohttp_compat import _reads, check, internals_missing
from resilience.adapters.control_lane import LaneRoute, routed
from resilience.adapters.control_pools import _LANE_SLOT, AiohttpLane
from resilience.adapters.driver_config import UNSET, ConfigViews, DriverConfig, DriverKeywords, Unset, driver_config
from resilience.adapters.routing import Route, RouteCache, engine_of
from resilience.errors import ErrorTypes
from resilience.outcome import Delivery
from resilience.policy import PolicyTable
from resilience.retry.spec import AttemptResult, CallSpec, Timeouts, responded

if TYPE_CHECKING:
    from aiohttp import ClientHandlerType

check(aiohttp.__version__, internals_missing(aiohttp))  # an aiohttp whose internals differ fails here, naming its version

__all__ = ["ERROR_TYPES", "ResilientMiddleware", "caller_timeout", "request_timeout"]

_DRAIN_LIMIT = 64 * 1024
"""A discarded response body up to this many bytes is read, so the connection can be reused."""
_DRAIN_TIMEOUT_S = 1.0
"""The longest a discarded response body is read before the connection is closed instead."""
_NOT_TRANSIENT: tuple[type[BaseException], ...] = (
    aiohttp.InvalidURL,
    aiohttp.NonHttpUrlClientError,
    aiohttp.ClientSSLError,
    aiohttp.ClientConnectorCertificateError,
    aiohttp.ServerFingerprintMismatch,
)
"""Errors raised at once, never retried: a bad URL, TLS trouble, a pinned fingerprint that does not match.

Each is raised before the request is written (``_never_sent_unretried``)."""


_SESSION_CLOSED = "Session is closed"
"""What aiohttp raises for a closed session, and what ``_Attempts.run`` raises, before sending, for one closed during a backoff."""


def _never_sent_unretried(exc: BaseException) -> bool:
    """Raised before a byte of the request left (recorded as not sent): one of ``_NOT_TRANSIENT``, or ``_Attempts.run``'s closed session."""
    return isinstance(exc, _NOT_TRANSIENT) or (type(exc) is RuntimeError and exc.args == (_SESSION_CLOSED,))

ERROR_TYPES = ErrorTypes(
    deadline_exceeded=errors.DeadlineExceeded,
    circuit_open=errors.CircuitOpen,
    ambiguous=errors.AmbiguousOutcome,
    budget_exhausted=errors.RetryBudgetExhausted,
    retries_exhausted=errors.RetriesExhausted,
)
"""The classes the middleware's retry loop raises: ``aiohttp.ClientError`` subclasses of the core's errors."""


_GIVEN_UP: ContextVar[tuple[object, BaseException] | None] = ContextVar("resilience_aiohttp_given_up", default=None)
"""(the request's timer, the error) of this task's last call that ended on a dropped connection.

aiohttp's own re-run of that request (``retry_persistent_connection``; why it
gets the same error at once: ``docs/http-clients.md``) finds it here.
"""


def caller_timeout(timeout: ClientTimeout) -> tuple[float | None, float | None] | None:
    """The caller's (connect, read) seconds from an aiohttp ``ClientTimeout``; None for aiohttp's default.

    connect: the smaller of ``sock_connect`` and ``connect`` (else ``total``);
    read: ``sock_read`` (else ``total``). None inside the pair = no limit.
    """
    if timeout is DEFAULT_TIMEOUT:
        return None
    connects = [t for t in (timeout.sock_connect, timeout.connect) if t is not None and t > 0]
    total = timeout.total if timeout.total is not None and timeout.total > 0 else None
    connect = min(connects) if connects else total
    read = timeout.sock_read if timeout.sock_read is not None and timeout.sock_read > 0 else total
    return connect, read


def request_timeout(request: ClientRequest, handler: ClientHandlerType) -> ClientTimeout:
    """The ``ClientTimeout`` aiohttp applies to this request: its own ``timeout=``, else the session's.

    Where aiohttp has the public ``ClientRequest.timeout`` (3.15 and later),
    that; else the ``real_timeout`` closure cell, reached through the
    middleware chain's ``next_h`` cells (``_aiohttp_compat`` says where, and
    checks at import that they are there), and the session's timeout when the
    closure is not shaped so.
    """
    cls = type(request)
    try:
        public = _PUBLIC_TIMEOUT[cls]
    except KeyError:
        public = _PUBLIC_TIMEOUT[cls] = hasattr(request, "timeout")
    if public:
        found = request.timeout  # type: ignore[attr-defined]
        if isinstance(found, ClientTimeout):
            return found
    fn: Any = handler
    for _ in range(64):  # a chain of middlewares, each closure holding the next handler
        try:
            code, cells = fn.__code__, fn.__closure__
        except AttributeError:  # not a plain function
            break
        if type(code) is not CodeType or cells is None:
            break
        for slots in _SLOTS:  # compared by identity, calling nothing (see ``_SLOTS``)
            if slots[0] is code:
                break
        else:
            slots = _closure_slots(code)
        _, timeout_at, next_at = slots
        try:
            if timeout_at >= 0:
                found = cells[timeout_at].cell_contents
                if type(found) is ClientTimeout or isinstance(found, ClientTimeout):
                    return found
                break
            if next_at < 0:
                break
            fn = cells[next_at].cell_contents
        except (IndexError, ValueError):  # an empty cell
            break
    return request.session.timeout


_PUBLIC_TIMEOUT: dict[type[ClientRequest], bool] = {}
"""Request class -> whether its requests have a ``timeout`` (aiohttp 3.15's public one, or a ``request_class=``'s): asked once."""


_SLOTS: list[tuple[CodeType, int, int]] = []
"""(a handler's code, ``_closure_slots(code)``) for the few handler codes seen (aiohttp's own and each middleware's), at most 16.

Looked up by identity in a list: a code object's hash walks its constants
and names on every lookup (an ``lru_cache`` keyed by the code paid that on
each hop of every request).
"""


def _closure_slots(code: CodeType) -> tuple[CodeType, int, int]:
    """(``code``, where a handler's closure keeps ``real_timeout``, ``next_h``) (-1: not there); remembered in ``_SLOTS``."""
    names = code.co_freevars
    slots = (code, names.index("real_timeout") if "real_timeout" in names else -1, names.index("next_h") if "next_h" in names else -1)
    if len(_SLOTS) >= 16:
        _SLOTS.clear()
    _SLOTS.append(slots)
    return slots


_body_of = operator.attrgetter("_body" if _reads(vars(ClientRequest).get("body"), "_body") else "body")
"""A request's body with no property call: aiohttp 3.14's ``_body`` (None: no body), where ``ClientRequest.body`` reads it."""
_PLAIN_BODIES = frozenset({bytes, BytesPayload})


def _replayable(request: ClientRequest) -> bool:
    """Bytes-like payloads (bytes, str, JSON, url-encoded forms) and seekable files can be sent again; nothing else."""
    body = request.body
    if isinstance(body, (bytes, BytesPayload)):
        return True
    if isinstance(body, IOBasePayload):
        try:  # aiohttp rewinds a file to where the first attempt started reading, if it can seek
            return not body.consumed and bool(getattr(body, "_value").seekable())  # noqa: B009 (no public accessor)
        except (AttributeError, OSError, ValueError):
            return False
    return False


async def _body_bytes(request: ClientRequest) -> bytes | None:
    """The body as bytes for a probe (``CallSpec.body``): bytes and bytes-like payloads (JSON, text, forms); else None."""
    body = request.body
    if isinstance(body, bytes):
        return body
    if isinstance(body, BytesPayload):
        return await body.as_bytes()  # a bytes payload reads its own value: nothing is consumed
    return None


def _transport_failure(exc: aiohttp.ClientError | OSError, sent: bool) -> tuple[Delivery, str]:
    """Did a failed attempt surely never reach the server? And a bounded name for it (as the requests adapter names them)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return Delivery.NOT_SENT, "connect_timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, DNS, proxy refused
        return Delivery.NOT_SENT, "connect_error"
    if isinstance(exc, asyncio.TimeoutError):  # SocketTimeoutError, or another ServerTimeoutError
        return (Delivery.AMBIGUOUS, "read_timeout") if sent else (Delivery.NOT_SENT, "connect_timeout")
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError, OSError)):
        return Delivery.AMBIGUOUS, "connection_reset"
    return Delivery.AMBIGUOUS, "error"


async def _discard(response: ClientResponse) -> None:
    """Read a small body (so the connection is reused) and release a response that will not be returned."""
    try:
        length = response.content_length
        if length is not None and length <= _DRAIN_LIMIT:
            async with asyncio.timeout(_DRAIN_TIMEOUT_S):
                await response.read()
    except (aiohttp.ClientError, OSError):  # asyncio.TimeoutError is an OSError
        pass
    finally:
        response.release()


class _Timers:
    """The attempt timers of one event loop, behind one ``loop.call_at`` handle armed at the earliest limit it knows.

    (A handle per attempt would be built, pushed on the loop's heap and
    compared there in Python until it pops, cancelled, long after most
    attempts end.) An attempt (its call's ``_Attempts``) joins ``timers``, moves its limit in place
    and leaves it; the handle is re-armed (``arm``) only when a limit comes
    earlier than the one it is armed at. When it fires, every attempt whose
    limit has come expires (its task is cancelled, as ``asyncio.timeout``
    would) and the handle is armed at the next limit, if any: a limit that
    moved later is checked then. A stopped
    attempt leaves the handle armed (it fires once, finds nothing, and stays
    off). One per loop (``_timers_of``); only its loop's thread touches it.
    """

    __slots__ = ("_handle", "at", "loop", "now", "timers")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)
        """The loop (weakly: a loop's scheduled handle holds this object, so no strong reference back)."""
        self.now = time.monotonic if type(loop).time is asyncio.BaseEventLoop.time else None
        """The loop's clock read with no frame of its own (asyncio's ``time()`` returns ``time.monotonic()``); None: call ``loop.time``."""
        self.at = math.inf
        """Where the handle is armed (loop time; ``inf``: not armed). A timer whose limit is earlier calls ``arm``."""
        self._handle: asyncio.TimerHandle | None = None
        self.timers: dict[_Attempts, None] = {}
        """The attempts watched (a dict used as a set: adding and removing a key is no function call)."""

    def arm(self, loop: asyncio.AbstractEventLoop, limit_at: float) -> None:
        """Arm the handle at ``limit_at``, earlier than ``at`` (the caller checked: most limits come later, and call nothing)."""
        if self._handle is not None:
            self._handle.cancel()
        self.at = limit_at
        self._handle = loop.call_at(limit_at, self._fire)

    def _fire(self) -> None:
        at, self.at, self._handle = self.at, math.inf, None
        loop = self.loop()
        if loop is None:
            return
        following = math.inf
        for timer in tuple(self.timers):
            limit = timer.limit_at
            if limit is None or timer.expired:
                continue
            if limit <= at:  # due: the loop runs a handle at its time (within the clock's resolution)
                timer.expire()
            elif limit < following:
                following = limit
        if following < math.inf:
            self.arm(loop, following)


_LAST_TIMERS: _Timers | None = None
"""The ``_Timers`` looked up last (one loop per thread is the common case: no dictionary lookup then)."""
_TIMERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Timers] = weakref.WeakKeyDictionary()
"""Each loop's ``_Timers``; it goes with its loop."""


def _timers_of(loop: asyncio.AbstractEventLoop) -> _Timers:
    """``loop``'s ``_Timers``, made on first use (a timer checks ``_LAST_TIMERS`` itself first)."""
    global _LAST_TIMERS
    timers = _TIMERS.get(loop)
    if timers is None:
        timers = _TIMERS[loop] = _Timers(loop)
    _LAST_TIMERS = timers
    return timers


class _Attempts:
    """One call's attempts: aiohttp's ``handler`` for ``request`` (on ``lane``, when set), and the running attempt's limit.

    ``ResilientMiddleware.__call__`` builds it and sets those three fields (no
    ``__init__``: a frame less per call); ``run`` is one attempt, the loop's
    ``send``. A timed attempt's limit is ``connect_s`` until aiohttp has sent
    the request, then ``read_s`` from then on. "Sent" is aiohttp's
    ``ClientRequest.send`` returning (a connection is held and the request
    written to it): ``run`` wraps this attempt's ``send`` to move the limit
    then, so no timer polls. The loop's ``_Timers`` watches the limit. On
    expiry it cancels the attempt's task, as ``asyncio.timeout`` would;
    ``stop`` takes that cancellation back and says whether it was this
    limit's (a cancellation from anywhere else stays one), and ``error`` is
    the aiohttp error to raise then: ``ConnectionTimeoutError`` before
    sending, ``SocketTimeoutError`` after. An attempt that answered before its
    limit needs only ``stop``'s two ``del`` statements (``run`` writes them
    out: no ``stop`` frame on a success).
    """

    __slots__ = (
        "_cancelling", "_loop", "_read_s", "_send", "_task", "_timers", "expired", "handler", "lane", "limit_at", "request", "sent",
    )

    handler: ClientHandlerType
    request: ClientRequest
    lane: AiohttpLane | None
    """The control lane the attempts take their connection from (armed and disarmed in ``run``, as ``AiohttpLane``
    describes), or None."""
    limit_at: float | None
    """The loop time at which the running attempt times out now (None: no limit)."""
    _task: asyncio.Task[Any] | None
    """The running timed attempt's task (None once ``stop`` ran)."""

    async def run(self, n: int, timeouts: Timeouts, headers: MutableMapping[str, str]) -> AttemptResult[ClientResponse]:
        """One attempt: ``handler(request)`` bounded by its (connect, read) timeouts, with its headers.

        Transport errors are reported, not raised; a limit that ends the attempt
        is aiohttp's ``ConnectionTimeoutError`` or ``SocketTimeoutError``.
        """
        request, lane = self.request, self.lane
        session = _session_of(request)
        if n > 0:
            if session.closed:  # closed during the backoff: what aiohttp raises for a closed session
                raise RuntimeError(_SESSION_CLOSED)
            await request.close()  # the last attempt's body writer has settled: a file payload rewinds itself
        if headers:
            request.headers.update(headers)
        before = request.response
        connect_s, read_s = timeouts
        timed = connect_s is not None or read_s is not None
        if timed:  # the limit, watched by the loop's ``_Timers`` until the attempt ends
            self._loop = loop = request.loop  # the task's
            task = asyncio.current_task(loop)
            if task is None:  # a middleware always runs in a task; nothing to cancel on expiry otherwise
                raise RuntimeError("ResilientMiddleware must run inside an asyncio task")
            self._task, self._cancelling, self._read_s = task, task.cancelling(), read_s
            self.expired = self.sent = False
            timers = _LAST_TIMERS  # one loop per thread is the common case: no dictionary lookup then
            if timers is None or timers.loop() is not loop:
                timers = _timers_of(loop)
            self._timers = timers
            now = timers.now
            self.limit_at = limit_at = None if connect_s is None else (loop.time() if now is None else now()) + connect_s
            timers.timers[self] = None
            if limit_at is not None and limit_at < timers.at:
                timers.arm(loop, limit_at)
            self._send = request.send
            request.send = self._send_then_read  # type: ignore[method-assign]
        if lane is not None:  # arm (``AiohttpLane``): the lane's ``connect`` serves this request's one connection
            lane.armed[request] = None
            session._connector = lane.connector
        try:
            try:
                response = await self.handler(request)
            except (asyncio.CancelledError, TimeoutError) as exc:
                if not timed:
                    raise
                ours = self.stop()
                if not self.expired or (isinstance(exc, asyncio.CancelledError) and not ours):
                    raise  # not this attempt's limit: the caller's cancellation, or aiohttp's own timeout
                raise self.error() from exc
            except BaseException:
                if timed:
                    self.stop()
                raise
            finally:
                if lane is not None:  # disarm (``AiohttpLane``); the session's connector back if ``connect`` never ran
                    del lane.armed[request]
                    if session._connector is lane.connector:
                        session._connector = lane.owner
        except _NOT_TRANSIENT:
            raise
        except (aiohttp.ClientError, OSError) as exc:  # asyncio.TimeoutError is an OSError
            delivery, kind = _transport_failure(exc, sent=request.response is not before)
            return AttemptResult(error=exc, delivery=delivery, error_kind=kind)
        if timed:  # answered: a limit that fired takes its cancellation back (``stop``)
            if self.expired:
                self.stop()
            else:  # ``stop``'s two ``del`` statements, written out: every timed success runs them
                del request.send
                del self._timers.timers[self]
        return responded(response, response.status, response.headers)

    async def _send_then_read(self, conn: Connection) -> ClientResponse:
        """The request's own ``send``; then the limit becomes ``read_s`` from now."""
        response = await self._send(conn)
        self.sent = True
        now = self._timers.now
        self.limit_at = limit_at = None if self._read_s is None else (self._loop.time() if now is None else now()) + self._read_s
        if self._task is not None and limit_at is not None and limit_at < self._timers.at:
            self._timers.arm(self._loop, limit_at)
        return response

    def expire(self) -> None:
        """The limit has come (``_Timers``): cancel the attempt's task."""
        if self._task is not None:
            self.expired = True
            self._task.cancel()

    def stop(self) -> bool:
        """Leave the loop's timers and give the request its own ``send`` back, once; True when this limit cancelled the task (a timeout).

        A limit that fired takes its cancellation back (``uncancel``), as
        ``asyncio.timeout`` does on exit; True only when no other
        cancellation of the task is pending.
        """
        task = self._task
        if task is None:
            return False
        self._task = None
        del self.request.send  # back to the class's method
        del self._timers.timers[self]
        return self.expired and task.uncancel() <= self._cancelling

    def error(self) -> aiohttp.ServerTimeoutError:
        """What aiohttp raises for this limit: a read timeout once sent, a connection timeout before."""
        if self.sent:
            return aiohttp.SocketTimeoutError(f"Timeout on reading data from socket to {self.request.url.origin()}")
        return aiohttp.ConnectionTimeoutError(f"Connection timeout to host {self.request.url.origin()}")


def _probe_response(request: ClientRequest) -> ClientResponse:
    """The body-less 200 returned when a probe confirms that an ambiguous request was applied.

    Built with the session's response class; aiohttp 3.14 also wants the
    request's stream writer (only its ``output_size`` is read), 3.12 does not.
    The headers and body that ``start()`` would set are written to the
    attributes ``_aiohttp_compat`` names.
    """

    class _Sent:
        output_size = 0

    kwargs: dict[str, Any] = {
        "writer": None,
        "continue100": None,
        "timer": None,
        "request_info": request.request_info,
        "traces": [],
        "loop": asyncio.get_running_loop(),
        "session": request.session,
    }
    try:
        response = request.response_class(request.method, request.url, stream_writer=cast(Any, _Sent()), **kwargs)
    except TypeError:  # aiohttp before the stream_writer argument
        response = request.response_class(request.method, request.url, **kwargs)
    response.status = 200
    response.reason = "Applied (confirmed by probe)"
    response._headers = CIMultiDictProxy(CIMultiDict())
    response._raw_headers = ()
    response._body = b""
    response.probe_confirmed = True  # type: ignore[attr-defined]
    return response


def _route(policies: PolicyTable, method: str, url: str) -> Route:
    """``route_of`` for aiohttp: the path as yarl decodes it (``URL.path``), which is what the table matched before."""
    parsed = URL(url)
    host = parsed.host or ""
    method = method.upper()
    engine, host, port = engine_of(f"{parsed.scheme}://{f'[{host}]' if ':' in host else host}:{parsed.port or ''}")
    return method, policies.match(method, parsed.path), engine, host, port


_session_of = operator.attrgetter("_session")
"""A request's session with no property call (``_aiohttp_compat`` checks that ``ClientRequest.session`` reads ``_session``)."""
_lane_of = operator.attrgetter(_LANE_SLOT)
"""A session connector's ``AiohttpLane`` or None, once ``AiohttpLane.of`` decided (AttributeError before): an attribute read, no call."""
_YARL_PARTS = all(hasattr(URL("http://h:1/p"), part) for part in ("_scheme", "_netloc", "_path"))
"""yarl (1.13 and later) keeps a URL's parts as attributes: the route key reads them, with no ``str(url)``. Else the string."""


class ResilientMiddleware(ConfigViews):
    """An aiohttp client middleware that runs the resilience retry loop around every request.

    ``config``: a ``DriverConfig`` (kept as ``.driver_config``) shared with other drivers (its breakers and
    budgets per engine, ``scheme://host:port``, included). Or, instead, its
    fields as keywords (``policies`` and ``DriverKeywords``, each with the
    field's meaning and default); ``config`` with any of them raises
    ``ConfigConflict``. Backoff sleeps are ``asyncio.sleep``. One middleware
    may serve many sessions and loops; its breakers and budgets are shared by
    all of them.
    """

    def __init__(
        self,
        policies: PolicyTable | Unset | None = UNSET,
        *,
        config: DriverConfig | None = None,
        **keywords: Unpack[DriverKeywords],
    ) -> None:
        self.driver_config = driver_config("ResilientMiddleware", config, policies=policies, **keywords)
        self.retrier = self.driver_config.retrier(ERROR_TYPES)
        config = self.driver_config
        self._routes: RouteCache[LaneRoute] = RouteCache(config.policies, routed(config.control_lane, _route))

    async def __call__(self, request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        """Run ``request`` as one logical call, calling ``handler`` once per attempt."""
        url = request.url
        method = request.method
        key = (method, url._scheme, url._netloc, url._path) if _YARL_PARTS else (method, str(url).partition("?")[0])
        try:
            method, match, engine, host, port, on_lane = self._routes.routes[key]
        except KeyError:
            method, match, engine, host, port, on_lane = self._routes.add(key, method, str(url))
        timeout = request_timeout(request, handler)
        body = _body_of(request)
        spec = CallSpec(  # every field by position: a class called with keywords builds a dict of them (CPython 3.11)
            method, url, match, engine, host, port,
            None if timeout is DEFAULT_TIMEOUT else caller_timeout(timeout),  # request_timeout
            request,
            body is None or type(body) in _PLAIN_BODIES or _replayable(request),  # replayable
            None if match.probe is None else await _body_bytes(request),  # body: only probes read it
        )

        # one per session.request() call, shared by aiohttp's re-runs of it (client.py builds each re-run's ClientRequest with
        # the same ``timer=``); no public attribute tells a re-run apart, so ``_aiohttp_compat`` checks this one at import
        timer = request._timer  # ``_aiohttp_compat`` checks that ``ClientRequest.__init__`` sets it
        rerun = method in IDEMPOTENT_METHODS  # the only requests aiohttp re-runs
        given_up = _GIVEN_UP.get() if rerun else None
        if given_up is not None:
            _GIVEN_UP.set(None)
            if timer is not None and given_up[0] is timer:
                raise given_up[1]  # aiohttp re-runs the request; this call already spent its attempts
        lane = None
        if on_lane:  # control routes' own connector (adapters/control_lane.py), kept on the session's connector
            try:
                lane = _lane_of(_session_of(request)._connector)
            except AttributeError:  # asked once per connector (``AiohttpLane.of`` keeps its answer there, None included)
                lane = AiohttpLane.of(request.session, self.driver_config.control_lane)
        try:
            attempts = _Attempts()  # no ``__init__`` (see ``_Attempts``)
            attempts.handler, attempts.request, attempts.lane = handler, request, lane
            probe_done = None if match.probe is None else functools.partial(_probe_response, request)  # only a probe's "done" reads it
            response, records = await self.retrier.arun(
                spec, attempts.run, discard=_discard, on_probe_done=probe_done, never_sent=_never_sent_unretried
            )
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if timer is not None and rerun and not isinstance(exc, aiohttp.ClientConnectorError):
                _GIVEN_UP.set((timer, exc))
            raise
        response.attempts = records  # type: ignore[attr-defined]
        response.endpoint = match.endpoint  # type: ignore[attr-defined]
        return response
