"""``ControlLane``: control calls get connections of their own, never queued behind streaming generation.

What it is for (prime-rl #1111: a weight update took 8.58 s behind 4,000
streams on one shared pool, 55 ms on a pool of its own), which routes are
control (``ControlLane.carries``), why it is on by default and how it closes:
``docs/http-clients.md`` ("Control calls get a lane of their own").

Every driver built from a ``DriverConfig`` whose ``control_lane`` is set (the
default) sends the control routes of its policy table over a second, small
pool of its own, beside the one it was given (one per library, with its TLS
settings: ``adapters/control_pools.py``). ``DriverConfig(control_lane=None)``
turns it off (one pool for everything). Headers, auth included, pass to the
lane's pool unchanged (it is the same request), and nothing here logs.
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
