"""``ControlLane``: control calls get connections of their own, never queued behind streaming generation.

The field's finding (prime-rl #1111): on one shared pool, a weight update took
8.58 s while 4,000 generations streamed; through a dedicated admin client it
took 55 ms. A streaming generation holds its connection for as long as it
streams, so once the pool's limit is reached (httpx's 100 connections, an
aiohttp ``TCPConnector(limit=100)``, a requests pool with ``pool_block=True``)
a ``/pause_generation`` or ``/update_weights`` waits for a stream to end.

Every driver built from a ``DriverConfig`` whose ``control_lane`` is set (the
default) sends the control routes of its policy table over a second, small
pool of its own, beside the one it was given (one per library, with its TLS
settings: ``adapters/control_pools.py``). The lane has no
connection limit (a control call never waits for a connection) and keeps a
few idle connections open for the next call.

**Which routes are control.** A request whose route matched an entry of the
policy table (``EndpointMatch.explicit``) other than a generation route
(``ControlLane.data_paths``: ``/generate``, ``/v1/completions``,
``/v1/chat/completions``, ...). So with ``SGLANG_POLICIES`` or
``VLLM_POLICIES``: pause, continue, flush, abort, release, resume, every
weight update, ``/health``, ``/server_info``, ``/v1/models``; and a request no
entry matches (the default policy) stays on the pool it was given, as does
everything with an empty table.

**Why on by default.** The failure it prevents is silent until it is costly
(a pause that times out behind streams, a barrier that declares a healthy
engine stuck), and it costs at most ``idle_connections`` kept-open sockets
per engine per driver; with an empty policy table it changes nothing.
``DriverConfig(control_lane=None)`` turns it off (one pool for everything, as
before).

Headers, auth included, pass to the lane's pool unchanged (it is the same
request), and nothing here logs. The lane closes with the pool it stands
beside: ``Session.close()``, ``httpx.Client.close()`` (or leaving its
``with``), the aiohttp session's connector's ``close()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from resilience.adapters.routing import Route
from resilience.errors import require
from resilience.policy import EndpointMatch, PolicyTable

__all__ = ["DATA_PATHS", "DEFAULT_LANE", "ControlLane", "LaneRoute", "routed"]

DATA_PATHS: Final[frozenset[str]] = frozenset(
    {
        "/generate",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/score",
        "/v1/rerank",
        "/encode",
        "/classify",
        "/pooling",
    }
)
"""Generation and inference routes (SGLang 0.5.23 ``entrypoints/http_server.py``, vLLM 0.33.0's OpenAI routes):
the data plane, kept on the pool the driver was given even when the policy table names them."""


@dataclass(frozen=True, slots=True)
class ControlLane:
    """How control routes get connections of their own (``DriverConfig.control_lane``; see the module docstring).

    ``idle_connections``: idle connections the lane keeps open for the next
    control call, per engine (requests: urllib3's ``pool_maxsize``; httpx:
    ``max_keepalive_connections`` of the lane's transport, times 8 so that a
    few engines keep theirs; aiohttp keeps what its connector keeps, for
    ``keepalive_timeout``); more control calls at once each open one of their
    own, never wait. Default 2 (one call in flight and one health check).
    ``data_paths``: path templates that are generation, never on the lane
    even when the table names them (default ``DATA_PATHS``).
    """

    idle_connections: int = 2
    data_paths: frozenset[str] = DATA_PATHS

    def __post_init__(self) -> None:
        require(
            type(self.idle_connections) is int and self.idle_connections >= 1,
            "ControlLane",
            "idle_connections",
            "an int >= 1",
            self.idle_connections,
        )
        require(
            isinstance(self.data_paths, frozenset) and all(isinstance(p, str) and p.startswith("/") for p in self.data_paths),
            "ControlLane",
            "data_paths",
            "a frozenset of path templates starting with '/'",
            self.data_paths,
        )

    def carries(self, match: EndpointMatch) -> bool:
        """Whether a request so routed goes on the lane: a table entry matched, and it is not a generation route."""
        return match.explicit and match.template not in self.data_paths


LaneRoute = tuple[str, EndpointMatch, str, str, int, bool]
"""A ``Route`` and whether it takes the control lane (``ControlLane.carries``), decided once per route."""


def routed(lane: ControlLane | None, build: Callable[[PolicyTable, str, str], Route]) -> Callable[[PolicyTable, str, str], LaneRoute]:
    """``build`` for a ``RouteCache`` whose routes also say whether they take ``lane`` (None: never)."""

    def route(policies: PolicyTable, method: str, url: str) -> LaneRoute:
        method, match, engine, host, port = build(policies, method, url)
        return method, match, engine, host, port, lane is not None and lane.carries(match)

    return route


DEFAULT_LANE: Final = ControlLane()
"""The lane every driver gets unless told otherwise: ``ControlLane()``'s defaults."""
