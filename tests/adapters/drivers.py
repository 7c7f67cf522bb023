"""The four drivers of the retry core behind one small test-facing interface.

``requests`` (``ResilientAdapter``), ``httpx`` (``ResilientTransport`` on an
``httpx.Client``), ``httpx-async`` (``AsyncResilientTransport`` on an
``httpx.AsyncClient``) and ``aiohttp`` (``ResilientMiddleware`` on an
``aiohttp.ClientSession``). An async driver owns one event loop in a thread,
its client lives on that loop, and ``call`` runs one request there; ``start``
hands back the ``concurrent.futures.Future`` so a test can cancel the calling
task.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import requests

from resilience.adapters.driver_config import DriverConfig
from resilience.breaker import BreakerConfig, BreakerRegistry
from resilience.budget import RetryBudgetConfig
from resilience.events import Observer
from resilience.outcome import AttemptRecord
from resilience.policy import PolicyTable

DRIVERS = ("requests", "httpx", "httpx-async", "aiohttp")
NATIVE_ERRORS: dict[str, type[BaseException]] = {
    "requests": requests.RequestException,
    "httpx": httpx.HTTPError,
    "httpx-async": httpx.HTTPError,
    "aiohttp": aiohttp.ClientError,
}
"""What a caller of each library already catches: the loop's own errors must be among them."""


@dataclass(frozen=True)
class Answer:
    status: int
    attempts: tuple[AttemptRecord, ...]


class Driver:
    """One client of one library with the resilience layer mounted; ``call`` blocks until the answer."""

    def __init__(
        self,
        name: str,
        policies: PolicyTable | None = None,
        *,
        breaker: BreakerConfig | None = None,
        retry_budget: RetryBudgetConfig | None = None,
        observers: Sequence[Observer] = (),
        config: DriverConfig | None = None,
        pool: int | None = None,
    ) -> None:
        """``config``: build the layer from this ``DriverConfig`` alone (then ``policies``, ``breaker``,
        ``retry_budget`` and ``observers`` must be left out). ``pool``: at most this many connections per engine (the
        library's own pool limit; None = its default)."""
        self.name = name
        self.native = NATIVE_ERRORS[name]
        if config is not None:
            assert policies is None and breaker is None and retry_budget is None and not observers, "config= holds those"
            self._kwargs: dict[str, Any] = {"config": config}
        else:
            self._kwargs = {"policies": policies, "breaker": breaker, "retry_budget": retry_budget, "observers": observers}
        self._pool = pool
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self.layer: Any = None
        """The mounted resilience object (adapter, transport or middleware)."""
        if name == "requests":
            from resilience.adapters.requests import ResilientAdapter

            pooling = {} if pool is None else {"pool_connections": 1, "pool_maxsize": pool, "pool_block": True}
            self.layer = ResilientAdapter(**self._kwargs, **pooling)
            self._client = requests.Session()
            self._client.mount("http://", self.layer)
            self._client.mount("https://", self.layer)
        elif name == "httpx":
            from resilience.adapters.httpx import ResilientTransport

            inner = None if pool is None else httpx.HTTPTransport(limits=httpx.Limits(max_connections=pool))
            self.layer = ResilientTransport(transport=inner, **self._kwargs)
            self._client = httpx.Client(transport=self.layer)
        else:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
            self._thread.start()
            self._run(self._open())

    async def _open(self) -> None:
        if self.name == "httpx-async":
            from resilience.adapters.httpx import AsyncResilientTransport

            pool = self._pool
            inner = None if pool is None else httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=pool))
            self.layer = AsyncResilientTransport(transport=inner, **self._kwargs)
            self._client = httpx.AsyncClient(transport=self.layer)
        else:
            from resilience.adapters.aiohttp import ResilientMiddleware

            self.layer = ResilientMiddleware(**self._kwargs)
            connector = None if self._pool is None else aiohttp.TCPConnector(limit=self._pool)
            self._client = aiohttp.ClientSession(middlewares=(self.layer,), connector=connector)

    @property
    def breakers(self) -> BreakerRegistry:
        """The breaker registry of the mounted layer."""
        registry = self.layer.retrier.breakers
        assert isinstance(registry, BreakerRegistry)
        return registry

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, method: str, url: str, *, json: Any = None, timeout: float | None = None) -> Future[Answer]:
        """An async driver's call as a future (cancel it to cancel the calling task)."""
        assert self._loop is not None, f"{self.name} is not an async driver"
        return asyncio.run_coroutine_threadsafe(self._acall(method, url, json, timeout), self._loop)

    def call(self, method: str, url: str, *, json: Any = None, timeout: float | None = None) -> Answer:
        """One request; a caller's ``timeout`` (seconds, both connect and read) is passed the library's way."""
        if self.name == "requests":
            response = self._client.request(method, url, json=json, timeout=timeout)
            return Answer(response.status_code, response.attempts)
        if self.name == "httpx":
            response = self._client.request(method, url, json=json, timeout=timeout)
            return Answer(response.status_code, response.extensions["attempts"])
        return self.start(method, url, json=json, timeout=timeout).result(60)

    async def _acall(self, method: str, url: str, json: Any, timeout: float | None) -> Answer:
        if self.name == "httpx-async":
            response = await self._client.request(method, url, json=json, timeout=timeout)
            return Answer(response.status_code, response.extensions["attempts"])
        client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout) if timeout is not None else None
        async with self._client.request(method, url, json=json, timeout=client_timeout) as response:
            await response.read()
            return Answer(response.status, response.attempts)

    def close(self) -> None:
        if self._loop is None:
            self._client.close()
            return
        if self._client is not None:
            close = self._client.aclose() if self.name == "httpx-async" else self._client.close()
            self._run(close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(timeout=10)
        self._loop.close()
