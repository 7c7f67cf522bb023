"""Backends for the barrier suite: the thread fan-out and the async fan-out always, Ray when it is installed.

The same tests run on each (``backend`` fixture): ``SGLangClient`` over
``ThreadFanOut``, ``AsyncSGLangClient`` over ``AsyncFanOut`` (one fan-out per
test; its clients are closed on its loop at teardown), Ray engine actors over
``RayFanOut``. Engines are emulated SGLang processes, and call order is read
from the emulator's server-side record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from resilience.adapters.sglang import AsyncSGLangClient, SGLangClient
from resilience.barrier.async_fanout import AsyncFanOut
from resilience.barrier.fanout import FanOut, ThreadFanOut
from resilience.policy import PolicyTable
from tests.sglang.conftest import FAST_SGLANG

Backend = tuple[str, Callable[..., list[Any]], Callable[[], FanOut]]
"""(name, make(urls, policies=FAST_SGLANG) -> engines, make the fan-out)."""


def _thread_engines(urls: list[str], policies: PolicyTable = FAST_SGLANG) -> list[Any]:
    return [SGLangClient(u, policies=policies) for u in urls]


@pytest.fixture(params=["threads", "async", "ray"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """(name, make engines from URLs, make the fan-out) for each backend."""
    if request.param == "threads":
        yield ("threads", _thread_engines, ThreadFanOut)
        return
    if request.param == "async":
        fanout = AsyncFanOut()
        clients: list[AsyncSGLangClient] = []

        def make_async(urls: list[str], policies: PolicyTable = FAST_SGLANG) -> list[Any]:
            made = [AsyncSGLangClient(u, policies=policies) for u in urls]
            clients.extend(made)
            return list(made)

        try:
            yield ("async", make_async, lambda: fanout)
        finally:
            for client in clients:
                fanout.run(client.aclose(), timeout=10)
            fanout.close()
        return
    request.getfixturevalue("ray_runtime")
    from resilience.adapters.ray import RayFanOut, ray_engines

    def make(urls: list[str], policies: PolicyTable = FAST_SGLANG) -> list[Any]:
        return list(ray_engines(urls, client_kwargs={"policies": policies}))

    yield ("ray", make, RayFanOut)
