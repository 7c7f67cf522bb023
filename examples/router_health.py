"""Recipe: a health check that never ejects an engine the orchestrator paused, and still ejects a dead one.

A paused SGLang engine's ``GET /health`` waits for scheduler output that never
comes while generation is paused: it hangs about 20 s, then answers 503
(``sglang/srt/entrypoints/http_server.py``, ``health_generate``). A router
(sgl-router / sgl-model-gateway: ``--health-check-timeout-secs 5``,
``--health-failure-threshold 3``) or a restart controller that trusts that
answer ejects or restarts every engine we paused for training.

The answer to give, per engine URL (``scheme://host:port``, the name the
orchestrator knows it by):

- held paused by the orchestrator (``orch.held()`` names it): do not ask
  ``/health``. Ask ``GET /model_info`` instead: the HTTP process answers it
  without the scheduler, so it answers at once while paused. 2xx: healthy
  ("paused by us"). No answer or a refused connection: dead (SGLang kills the
  whole process tree when the scheduler dies, so a dead engine refuses).
- not held: its own ``GET /health`` within a short timeout; 2xx is healthy,
  anything else (503, no answer, refused) is not.

:class:`HealthMonitor` applies it the way sgl-model-gateway's checker does:
checks every engine, counts consecutive failures, and ejects an engine at
``failure_threshold``; a success resets the count. Run one in your trainer,
where the orchestrator lives, and let it drive the router (see docs/routers.md,
"Health monitors and routers").
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import requests

__all__ = ["HealthAnswer", "HealthMonitor", "Holds", "health_answer"]


class Holds(Protocol):
    """What the recipe needs of ``resilience.barrier.Orchestrator``."""

    def held(self) -> dict[str, tuple[str, ...]]:
        """Engines held paused on purpose, by URL, with the reasons."""
        ...


@dataclass(frozen=True, slots=True)
class HealthAnswer:
    """The health answer to give for one engine."""

    status: int
    """200 (keep it) or 503 (count a failure)."""
    reason: str
    """``healthy``, ``paused by us (offload)``, ``dead: connection refused``, ``/health answered 503``, ..."""

    @property
    def healthy(self) -> bool:
        """True for a 2xx answer."""
        return 200 <= self.status < 300


def _get(session: requests.Session, url: str, timeout_s: float, headers: Mapping[str, str]) -> tuple[int | None, str]:
    try:
        response = session.get(url, timeout=timeout_s, headers=dict(headers), allow_redirects=False)
    except requests.ConnectTimeout:
        return None, f"no connection in {timeout_s:g} s"
    except requests.ReadTimeout:
        return None, f"no answer in {timeout_s:g} s"
    except requests.ConnectionError:
        return None, "connection refused or dropped"
    response.close()
    return response.status_code, f"answered {response.status_code}"


def health_answer(
    orch: Holds,
    url: str,
    *,
    session: requests.Session | None = None,
    timeout_s: float = 4.0,
    headers: Mapping[str, str] | None = None,
) -> HealthAnswer:
    """The answer for engine ``url``: healthy while held paused by ``orch`` and alive; else its own ``/health``.

    ``timeout_s``: per request; keep it below the router's own timeout (default 4 s vs smg's 5 s).
    ``headers``: e.g. ``{"Authorization": "Bearer ..."}`` for an engine started with an API key.
    An engine ``orch`` does not know is simply not held: ``orch.held()`` is asked, never a per-engine
    method, so any URL can be checked.
    """
    http = session if session is not None else requests.Session()
    try:
        reasons = orch.held().get(url)
        if reasons:
            status, what = _get(http, url + "/model_info", timeout_s, headers or {})
            if status is not None and 200 <= status < 300:
                return HealthAnswer(200, f"paused by us ({', '.join(reasons)})")
            return HealthAnswer(503, f"dead while paused by us: /model_info {what}")
        status, what = _get(http, url + "/health", timeout_s, headers or {})
        if status is not None and 200 <= status < 300:
            return HealthAnswer(200, "healthy")
        return HealthAnswer(503, f"/health {what}")
    finally:
        if session is None:
            http.close()


@dataclass
class HealthMonitor:
    """A router-style monitor: ``check()`` asks every engine at once; ``failure_threshold`` failures in a row eject it.

    ``orch``: whose holds count (an ``Orchestrator``). ``urls``: the engines to watch.
    ``failure_threshold``: consecutive failed answers that eject an engine (smg's default: 3).
    ``timeout_s``: per request (default 4 s). An ejected engine comes back after one healthy answer.
    """

    orch: Holds
    urls: Sequence[str]
    failure_threshold: int = 3
    timeout_s: float = 4.0
    failures: dict[str, int] = field(default_factory=dict)
    ejected: set[str] = field(default_factory=set)
    last: dict[str, HealthAnswer] = field(default_factory=dict)

    def check(self) -> dict[str, HealthAnswer]:
        """One round over every engine (in parallel, bounded by ``timeout_s``); returns the answers."""
        answers: dict[str, HealthAnswer] = {}

        def one(url: str) -> None:
            answers[url] = health_answer(self.orch, url, timeout_s=self.timeout_s)

        threads = [threading.Thread(target=one, args=(u,), daemon=True) for u in self.urls]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * self.timeout_s + 1)
        for url in self.urls:
            answer = answers.get(url, HealthAnswer(503, "no answer"))
            self.last[url] = answer
            if answer.healthy:
                self.failures[url] = 0
                self.ejected.discard(url)
            else:
                self.failures[url] = self.failures.get(url, 0) + 1
                if self.failures[url] >= self.failure_threshold:
                    self.ejected.add(url)
        return answers
