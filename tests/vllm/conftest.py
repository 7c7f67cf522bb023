"""vLLM clients for tests: the three transports (requests, aiohttp, httpx) behind one way to call them."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from resilience.adapters.httpx import AsyncResilientTransport
from resilience.adapters.vllm import VLLM_POLICIES, AsyncVLLMClient, VLLMClient
from resilience.events import Event, Observer
from resilience.policy import PolicyTable
from resilience.testing import fast_policies

FAST_VLLM: PolicyTable = fast_policies(VLLM_POLICIES, attempt_timeout_s=5.0, deadline_s=15.0)
"""VLLM_POLICIES' decisions with test-sized waits."""

TRANSPORTS = ("requests", "aiohttp", "httpx")
"""``VLLMClient`` over requests; ``AsyncVLLMClient`` over its own aiohttp session, or over an httpx.AsyncClient it is given."""


@asynccontextmanager
async def open_vllm(
    kind: str, url: str, events: list[Event] | None = None, policies: PolicyTable = FAST_VLLM, **kwargs: Any
) -> AsyncIterator[VLLMClient | AsyncVLLMClient]:
    """A vLLM client of ``url`` over ``kind`` (one of ``TRANSPORTS``), closed on the way out."""
    observers: list[Observer] = [events.append] if events is not None else []
    if kind == "requests":
        with VLLMClient(url, policies=policies, observers=observers, **kwargs) as client:
            yield client
    elif kind == "aiohttp":
        async with AsyncVLLMClient(url, policies=policies, observers=observers, **kwargs) as aclient:
            yield aclient
    else:
        transport = AsyncResilientTransport(policies, observers=observers)
        async with httpx.AsyncClient(transport=transport) as session:
            async with AsyncVLLMClient(url, session=session, **kwargs) as hclient:
                yield hclient
            assert not session.is_closed  # a session the caller passed stays open


async def do(client: VLLMClient | AsyncVLLMClient, method: str, *args: Any, **kwargs: Any) -> Any:
    """``client.method(...)``, awaited when the client is async: one test body for both twins."""
    result = getattr(client, method)(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result
