"""The control lane's pools, one builder per library (what they are for: ``adapters/control_lane.py``).

Each library is imported inside its builder: a driver calls only its own,
so none of them pulls in another library.

- requests: ``requests_lane`` is a plain ``HTTPAdapter`` (no retries, never
  blocking on its pool). The ``ResilientAdapter`` sends control routes
  through its ``send`` and closes it in its own ``close`` (a subclass's own
  ``init_poolmanager`` does not reach it: ``docs/http-clients.md``).
- httpx: ``httpx_lane`` / ``async_httpx_lane`` build a second transport with
  the wrapped ``httpx.HTTPTransport``'s TLS context, HTTP versions, local
  address, socket options and network backend (httpcore's ``ConnectionPool``
  keeps them as attributes), no connection limit. The wrapped pool's
  ``close`` / ``aclose`` is wrapped to close the lane first, so every way of
  closing the client (``close()``, leaving its ``with``) closes both. A
  transport of another class, or through a proxy, gets none.
- aiohttp: ``AiohttpLane`` is a ``TCPConnector`` beside the session's (with
  its TLS setting, address family, local address and resolver), one per
  session connector, kept on it (``AiohttpLane.of``; a connector that gets
  none keeps None there, so it is asked once). A control attempt hands
  aiohttp's handler the lane for its one connection (the swap
  ``AiohttpLane`` describes, written out in the middleware's attempt): the session's
  ``_connector`` is set to the lane just before the handler runs, and the
  lane's ``connect`` puts the session's connector back before anything can
  yield (aiohttp 3.12 to 3.14's ``ClientSession._request`` reads
  ``self._connector`` in the handler it builds; a middleware inside ours that
  yields before calling on would let another request find the lane, so the
  lane serves only the requests it was armed for and sends any other to the
  session's connector). The session's connector's ``close`` is wrapped to
  close the lane too.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from resilience.adapters.control_lane import ControlLane

if TYPE_CHECKING:
    import aiohttp
    import httpx
    from requests.adapters import HTTPAdapter

    Handler = Callable[[aiohttp.ClientRequest], Awaitable[aiohttp.ClientResponse]]
    """aiohttp's per-request handler, as a middleware gets it."""

__all__ = ["AiohttpLane", "async_httpx_lane", "httpx_lane", "requests_lane"]

_ENGINES = 8
"""How many engines a lane keeps idle connections for: requests' pool count, and httpx's one idle limit for
every origin (``idle_connections`` times this)."""
_LANE_SLOT = "_resilience_control_lane"
"""The attribute of an aiohttp connector that holds its lane."""


def requests_lane(lane: ControlLane | None) -> HTTPAdapter | None:
    """The ``HTTPAdapter`` control routes use (None: no lane); no retries of its own, a pool that never blocks."""
    if lane is None:
        return None
    from requests.adapters import HTTPAdapter

    return HTTPAdapter(pool_connections=_ENGINES, pool_maxsize=lane.idle_connections, pool_block=False, max_retries=0)


def _pool_settings(transport: object, pool_class: Any) -> dict[str, Any] | None:
    """The wrapped httpcore pool's settings to copy into the lane's, or None when the pool is not a plain ``pool_class``."""
    pool: Any = getattr(transport, "_pool", None)
    if type(pool) is not pool_class:
        return None
    try:
        return {
            "ssl_context": pool._ssl_context,
            "http1": pool._http1,
            "http2": pool._http2,
            "local_address": pool._local_address,
            "uds": pool._uds,
            "network_backend": pool._network_backend,
            "socket_options": pool._socket_options,
            "keepalive_expiry": pool._keepalive_expiry,
        }
    except AttributeError:  # an httpcore whose pool keeps them otherwise: no lane rather than a wrong one
        return None


def _close_first(owner: Any, name: str, first: Callable[[], object]) -> None:
    """Wrap ``owner.name`` (a close method) so that it calls ``first`` before itself."""
    original = getattr(owner, name)

    def close(*args: Any, **kwargs: Any) -> Any:
        first()
        return original(*args, **kwargs)

    setattr(owner, name, close)


def _aclose_first(owner: Any, name: str, first: Callable[[], Awaitable[object]]) -> None:
    """Wrap ``owner.name`` (an async close method) so that it awaits ``first`` before itself."""
    original = getattr(owner, name)

    async def aclose(*args: Any, **kwargs: Any) -> Any:
        await first()
        return await original(*args, **kwargs)

    setattr(owner, name, aclose)


def _httpx_lane(transport: object, lane: ControlLane | None, transport_class: Any, pool_class: Any) -> Any:
    """A ``transport_class`` whose ``pool_class`` pool copies the wrapped one's settings with no connection limit, or None.

    Its own first pool is dropped unclosed: it holds no connection yet (httpcore's ``close`` only closes connections).
    """
    if lane is None or type(transport) is not transport_class:
        return None
    settings = _pool_settings(transport, pool_class)
    if settings is None:
        return None
    ours: Any = transport_class()
    ours._pool = pool_class(max_connections=None, max_keepalive_connections=lane.idle_connections * _ENGINES, **settings)
    return ours


def httpx_lane(transport: httpx.BaseTransport, lane: ControlLane | None) -> httpx.HTTPTransport | None:
    """A transport for control routes beside ``transport`` (closed with it), or None (no lane, or settings that cannot be copied)."""
    import httpcore
    import httpx

    ours: httpx.HTTPTransport | None = _httpx_lane(transport, lane, httpx.HTTPTransport, httpcore.ConnectionPool)
    if ours is not None:
        _close_first(transport._pool, "close", ours.close)  # type: ignore[attr-defined]
    return ours


def async_httpx_lane(transport: httpx.AsyncBaseTransport, lane: ControlLane | None) -> httpx.AsyncHTTPTransport | None:
    """``httpx_lane`` for an async transport."""
    import httpcore
    import httpx

    ours: httpx.AsyncHTTPTransport | None = _httpx_lane(transport, lane, httpx.AsyncHTTPTransport, httpcore.AsyncConnectionPool)
    if ours is not None:
        _aclose_first(transport._pool, "aclose", ours.aclose)  # type: ignore[attr-defined]
    return ours


class AiohttpLane:
    """The lane of one aiohttp session connector: a ``TCPConnector`` of its own, and the handler swap that uses it.

    The swap, for one control request (the middleware's attempt writes it
    out: a method or a wrapping coroutine would cost every control call a
    frame):

    - arm: ``lane.armed[request] = None``, then the session's ``_connector`` set
      to ``lane.connector``, then ``await handler(request)``;
    - the lane's ``connect`` sets the session's connector back to ``owner``
      (before anything yields) and serves an armed request (any other goes to
      ``owner``);
    - disarm, however the handler ended: the request's key deleted, and
      ``owner`` put back if the handler never reached ``connect``.
    """

    __slots__ = ("armed", "connector", "owner")

    def __init__(self, owner: aiohttp.TCPConnector) -> None:

        self.owner = owner
        self.armed: dict[aiohttp.ClientRequest, None] = {}
        """The control requests in flight through the lane (a dict used as a set: adding and removing a key is no
        function call; a request hashes by identity)."""
        self.connector: aiohttp.TCPConnector = _lane_connector_class()(
            self,
            limit=0,
            limit_per_host=0,
            ssl=owner._ssl,
            family=owner._family,
            local_addr=_local_addr(owner),
            resolver=owner._resolver,
        )
        _aclose_first(owner, "close", self.connector.close)

    @staticmethod
    def of(session: aiohttp.ClientSession, lane: ControlLane | None) -> AiohttpLane | None:
        """The lane beside ``session``'s connector (made on first use), or None: no lane asked, or not a plain ``TCPConnector``.

        The answer is kept on the connector (``_LANE_SLOT``): the lane, or None
        for a connector of another class, so a control call reads one
        attribute and asks here once per connector.
        """
        import aiohttp

        connector = session.connector
        if lane is None or connector is None or connector.closed:
            return None
        found = getattr(connector, _LANE_SLOT, None)
        if isinstance(found, AiohttpLane):
            return found
        made = AiohttpLane(connector) if type(connector) is aiohttp.TCPConnector else None
        try:
            setattr(connector, _LANE_SLOT, made)
        except AttributeError:  # a connector class with __slots__: asked again next time
            pass
        return made


@functools.cache
def _lane_connector_class() -> type[Any]:
    """The lane's ``TCPConnector`` subclass, made once (aiohttp is imported here, on the first lane, not at import)."""
    import aiohttp

    class _LaneConnector(aiohttp.TCPConnector):
        def __init__(self, lane: AiohttpLane, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.lane = lane

        async def connect(self, req: aiohttp.ClientRequest, *args: Any, **kwargs: Any) -> aiohttp.connector.Connection:
            lane = self.lane
            session = req._session  # ``ClientRequest.session`` reads it (``_aiohttp_compat`` checks)
            if session._connector is self:
                session._connector = lane.owner  # back before anything yields
            if req not in lane.armed:
                return await lane.owner.connect(req, *args, **kwargs)
            return await super().connect(req, *args, **kwargs)

    return _LaneConnector


def _local_addr(owner: Any) -> tuple[str, int] | None:
    """The ``local_addr=`` the session's connector was built with (aiohttp keeps it as address infos), or None."""
    infos = getattr(owner, "_local_addr_infos", None)
    if not infos:
        return None
    address = infos[0][4]
    return (str(address[0]), int(address[1]))
