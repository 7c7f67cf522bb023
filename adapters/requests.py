"""``ResilientAdapter``: the retry loop as a ``requests`` transport adapter.

Mount it like any adapter (``session.mount("http://", adapter)``) or build a
session with ``resilient_session(policies)``. It overrides only
``HTTPAdapter.send`` (the documented seam), runs urllib3 with retries off so
it sees every attempt, and keeps every other contract of ``requests``: hooks,
redirects, auth, cookies, proxies, ``verify``, streaming and the three shapes
of ``timeout=``.

The attempts (``response.attempts``, ``error.attempts``) and the errors: ``docs/http-clients.md``.

Delivery: a refused or failed new connection, a connect timeout and a TLS
handshake that failed or timed out (the error's traceback passes through
urllib3's ``HTTPConnection.connect``, which runs before a byte of the request
is written) never left (``NOT_SENT``); a read timeout or a connection error on
an open connection may have been applied (``AMBIGUOUS``). requests gives
urllib3 no pool timeout, so a full pool (``pool_block=True``) waits for a
connection instead of failing.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Unpack, cast

import requests
from requests.adapters import DEFAULT_POOLBLOCK, DEFAULT_POOLSIZE, HTTPAdapter
from requests.models import PreparedRequest, Response
from requests.utils import rewind_body
from urllib3.connection import HTTPConnection
from urllib3.exceptions import ConnectTimeoutError
from urllib3.util import Timeout as Urllib3Timeout

from resilience.adapters.control_lane import routed
from resilience.adapters.control_pools import requests_lane
from resilience.adapters.driver_config import UNSET, ConfigViews, DriverConfig, DriverKeywords, Unset, driver_config
from resilience.adapters.requests_errors import ERROR_TYPES
from resilience.adapters.routing import RouteCache, route_of
from resilience.events import Observer
from resilience.outcome import Delivery
from resilience.policy import PolicyTable
from resilience.retry.spec import AttemptResult, CallSpec, responded

__all__ = ["ResilientAdapter", "exception_chain", "resilient_session", "resolve_timeout"]

_CONNECT_CODE = HTTPConnection.connect.__code__
"""urllib3's ``HTTPConnection.connect``: TCP connect (and for HTTPS, in the subclass's override, the TLS handshake)."""
_CONNECT_CODES: frozenset[object] = frozenset({_CONNECT_CODE, *(c.connect.__code__ for c in HTTPConnection.__subclasses__())})
_SECONDS = (int, float)
"""The classes of a ``timeout=`` taken as one number for both limits without building a urllib3 ``Timeout`` (not ``bool``)."""
TimeoutArg = float | tuple[float | None, float | None] | Urllib3Timeout | None


def resolve_timeout(timeout: object) -> Urllib3Timeout:
    """``timeout=`` as ``HTTPAdapter.send`` reads it, raising requests' own errors for invalid shapes.

    None, a number, a ``(connect, read)`` pair or a urllib3 ``Timeout``; the
    same checks and messages as requests (``Invalid timeout (3, 4, 5). Pass a
    (connect, read) timeout tuple, ...``) and urllib3 (``Timeout value connect
    was foo, but it must be an int, float or None.``).
    """
    if isinstance(timeout, tuple):
        try:
            connect, read = timeout
            return Urllib3Timeout(connect=connect, read=read)
        except ValueError:
            raise ValueError(
                f"Invalid timeout {timeout}. Pass a (connect, read) timeout tuple, "
                f"or a single float to set both timeouts to the same value."
            ) from None
    if isinstance(timeout, Urllib3Timeout):
        return timeout
    return Urllib3Timeout(connect=cast(Any, timeout), read=cast(Any, timeout))


@functools.lru_cache(maxsize=64)
def _urllib3_timeout(timeouts: tuple[float | None, float | None]) -> Urllib3Timeout:
    """The urllib3 ``Timeout`` of an attempt's (connect, read) seconds (None = no limit), one per pair seen.

    urllib3 clones the one it is handed before it times anything (``HTTPConnectionPool._get_timeout``), so one
    object serves every attempt.
    """
    return Urllib3Timeout(connect=timeouts[0], read=timeouts[1])


def _caller_pair(timeout: object) -> tuple[float | None, float | None]:
    """requests' ``timeout=`` as the caller's (connect, read) seconds; always the caller's word (None = no limit).

    A plain positive number needs no urllib3 ``Timeout``; anything else (NaN, <= 0, bools, pairs, ``Timeout``
    objects) goes through ``resolve_timeout``, which raises requests' own errors for invalid shapes.
    """
    if timeout is None:
        return None, None
    if timeout.__class__ in _SECONDS and timeout > 0:  # int or float (not bool)
        return float(timeout), float(timeout)
    resolved = resolve_timeout(timeout)
    return _seconds(resolved.connect_timeout), _seconds(resolved.read_timeout)


def _seconds(value: object) -> float | None:
    """A urllib3 ``Timeout``'s limit in seconds; None = no limit (also for urllib3's "socket default")."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _never_sent(exc: BaseException) -> bool:
    """A failure that surely happened before the request left: a new connection (to the server or a proxy) that failed.

    Walks what requests and urllib3 wrap: ``ConnectionError(MaxRetryError(reason=ProxyError(..., NewConnectionError)))``;
    not the contexts (an error raised while handling a connect failure may come after sending).
    """
    return any(isinstance(item, ConnectTimeoutError) for item in exception_chain(exc, contexts=False))  # NewConnectionError too


def exception_chain(exc: BaseException, *, contexts: bool = True) -> list[BaseException]:
    """``exc`` and what requests and urllib3 wrap in it: args, ``reason``, ``original_error``, causes and contexts (bounded).

    ``contexts`` (default True): follow ``__context__`` too.
    """
    seen: dict[int, BaseException] = {}
    todo: list[object] = [exc]
    while todo and len(seen) < 32:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen[id(item)] = item
        todo.extend(a for a in item.args if isinstance(a, BaseException))
        todo.extend([getattr(item, "reason", None), getattr(item, "original_error", None), item.__cause__])
        if contexts:
            todo.append(item.__context__)
    return list(seen.values())


def _in_connect(exc: BaseException) -> bool:
    """The failure happened while urllib3 opened the connection (TCP connect or TLS handshake): no byte of the request left.

    urllib3 opens a connection in ``HTTPConnection.connect`` (``HTTPSConnection.connect``
    adds the handshake) before it writes the request (``connectionpool._make_request``:
    ``_validate_conn`` first, then ``conn.request``); an error raised from inside it has
    that frame in its traceback. A handshake timeout is otherwise reported as a read timeout.
    """
    for item in exception_chain(exc):
        tb = item.__traceback__
        for _ in range(256):
            if tb is None:
                break
            if tb.tb_frame.f_code in _CONNECT_CODES:
                return True
            tb = tb.tb_next
    return False


def _never_sent_unretried(exc: BaseException) -> bool:
    """For an error raised out of an attempt unretried: a bad URL or scheme (nothing opened), or a failed TLS handshake."""
    if isinstance(exc, (requests.exceptions.InvalidURL, requests.exceptions.InvalidSchema)):
        return True
    return isinstance(exc, requests.exceptions.SSLError) and _in_connect(exc)


def _transport_failure(exc: requests.RequestException) -> tuple[Delivery, str]:
    """Did a failed attempt surely never reach the server? And a bounded name for it."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return Delivery.NOT_SENT, "connect_timeout"
    if isinstance(exc, requests.exceptions.ReadTimeout):
        if _in_connect(exc):  # the TLS handshake timed out: urllib3 calls it a read timeout
            return Delivery.NOT_SENT, "connect_timeout"
        return Delivery.AMBIGUOUS, "read_timeout"
    if isinstance(exc, requests.exceptions.ConnectionError):
        if _never_sent(exc) or _in_connect(exc):
            return Delivery.NOT_SENT, "connect_error"
        return Delivery.AMBIGUOUS, "connection_reset"
    return Delivery.AMBIGUOUS, "error"


def _discard(response: Response) -> None:
    """Read (to free the pooled connection) and close a response that will not be returned."""
    try:
        _ = response.content
    except (requests.RequestException, OSError, RuntimeError):
        pass
    response.close()


def _body_bytes(request: PreparedRequest) -> bytes | None:
    """The body as bytes for a probe (``CallSpec.body``): bytes and text as they are sent; a file or generator: None."""
    body = request.body
    if isinstance(body, bytes):
        return body
    return body.encode("utf-8") if isinstance(body, str) else None


def _body_rewindable(request: PreparedRequest) -> bool:
    """Bytes, text and files whose position requests could record (an int) can be sent again.

    A pipe or socket file gets a sentinel object as ``_body_position`` (its
    ``tell()`` failed); a generator gets None: neither can be rewound.
    """
    body = request.body
    if body is None or isinstance(body, (bytes, str)):
        return True
    position = getattr(request, "_body_position", None)
    return isinstance(position, int) and not isinstance(position, bool)


class ResilientAdapter(ConfigViews, HTTPAdapter):
    """An ``HTTPAdapter`` that runs the resilience retry loop around every send.

    ``config``: a ``DriverConfig`` (kept as ``.driver_config``) shared with other drivers (its breakers and
    budgets per engine included). Or, instead, its fields as keywords
    (``policies`` and ``DriverKeywords``, each with the field's meaning and
    default); ``config`` with any of them raises ``ConfigConflict``. ``pool_connections``,
    ``pool_maxsize`` and ``pool_block`` are ``HTTPAdapter``'s (its defaults);
    ``max_retries`` is accepted and ignored (always 0: this adapter owns the loop).
    """

    __attrs__ = [*HTTPAdapter.__attrs__, "driver_config"]  # noqa: RUF012

    def __init__(
        self,
        policies: PolicyTable | Unset | None = UNSET,
        *,
        pool_connections: int = DEFAULT_POOLSIZE,
        pool_maxsize: int = DEFAULT_POOLSIZE,
        pool_block: bool = DEFAULT_POOLBLOCK,
        max_retries: object = None,  # HTTPAdapter's, accepted and ignored: this adapter owns the loop
        config: DriverConfig | None = None,
        **keywords: Unpack[DriverKeywords],
    ) -> None:
        self.driver_config = driver_config("ResilientAdapter", config, policies=policies, **keywords)
        self._closed = False
        self._setup()
        super().__init__(pool_connections=pool_connections, pool_maxsize=pool_maxsize, max_retries=0, pool_block=pool_block)

    def _setup(self) -> None:
        """What the config decides: the route cache, the retrier, control routes' own pool (``adapters/control_lane.py``)."""
        config = self.driver_config
        self._routes = RouteCache(config.policies, routed(config.control_lane, route_of))
        self.retrier = config.retrier(ERROR_TYPES)
        self._lane = requests_lane(config.control_lane)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the pool, breakers and budgets after unpickling (Ray ships sessions this way)."""
        super().__setstate__(state)  # type: ignore[misc]
        self._setup()

    def close(self) -> None:
        """Close the pools, once: ``Session.close()`` calls it for every prefix, and one adapter is often mounted on two.

        A second close with nothing sent in between is a no-op, so a session
        closes each pool once, as with requests' one adapter per prefix.
        """
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self._lane is not None:
            self._lane.close()
        super().close()

    def send(
        self,
        request: PreparedRequest,
        stream: bool = False,
        timeout: TimeoutArg = None,
        verify: bool | str = True,
        cert: bytes | str | tuple[bytes | str, bytes | str] | None = None,
        proxies: Mapping[str, str] | None = None,
    ) -> Response:
        """Send ``request`` with the retry loop; same contract as ``HTTPAdapter.send``."""
        self._closed = False
        url = request.url or ""
        method, match, engine, host, port, on_lane = self._routes.route(request.method or "GET", url)
        spec = CallSpec(
            method, url, match, engine, host, port,
            request_timeout=_caller_pair(timeout),
            request=request,
            replayable=_body_rewindable(request),
            body=None if match.probe is None else _body_bytes(request),  # only probes read it
        )
        lane = self._lane
        sender = lane.send if on_lane and lane is not None else super().send

        def attempt(n: int, timeouts: tuple[float | None, float | None], carrier: MutableMapping[str, str]) -> AttemptResult[Response]:
            if n > 0 and request.body is not None and not isinstance(request.body, (bytes, str)):
                rewind_body(request)
            if carrier:
                request.headers.update(carrier)
            try:
                response = sender(
                    request, stream=stream, timeout=_urllib3_timeout(timeouts), verify=verify, cert=cert, proxies=proxies  # type: ignore[arg-type]
                )
            except (
                requests.exceptions.SSLError,
                requests.exceptions.InvalidURL,
                requests.exceptions.InvalidSchema,
                requests.exceptions.InvalidHeader,
            ):
                raise  # not transient: never retried
            except requests.RequestException as exc:
                delivery, kind = _transport_failure(exc)
                return AttemptResult(error=exc, delivery=delivery, error_kind=kind)
            return responded(response, response.status_code, response.headers)

        def probe_done() -> Response:
            resp = Response()
            resp.status_code = 200
            resp.reason = "Applied (confirmed by probe)"
            resp.url = url
            resp.request = request
            resp._content = b""
            resp.connection = self
            return resp

        response, records = self.retrier.run(spec, attempt, discard=_discard, on_probe_done=probe_done, never_sent=_never_sent_unretried)
        response.attempts = records  # type: ignore[attr-defined]
        response.endpoint = match.endpoint  # type: ignore[attr-defined]
        response.connection = self  # also when the lane sent it: an auth handler's re-send (``r.connection.send``) runs the loop
        return response


def resilient_session(
    policies: PolicyTable | Unset | None = UNSET,
    *,
    observers: Sequence[Observer] | Unset = UNSET,
    session: requests.Session | None = None,
    prefixes: Sequence[str] = ("http://", "https://"),
    **adapter_kwargs: Any,
) -> requests.Session:
    """A ``requests.Session`` (new, or the one given) with a ``ResilientAdapter`` mounted on ``prefixes``.

    Keyword arguments go to ``ResilientAdapter`` (``config``, or ``breaker``, ``retry_budget``, ``clock``, ...).
    """
    s = session if session is not None else requests.Session()
    adapter = ResilientAdapter(policies, observers=observers, **adapter_kwargs)
    for prefix in prefixes:
        s.mount(prefix, adapter)
    return s
