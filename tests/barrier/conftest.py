"""Backends for the barrier suite: the thread fan-out always, Ray when it is installed.

The same tests run on both (``backend`` fixture); engines are emulated SGLang
processes, and call order is read from the emulator's server-side record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from resilience.adapters.sglang import SGLangClient
from resilience.barrier.fanout import FanOut, ThreadFanOut
from resilience.policy import PolicyTable
from tests.sglang.conftest import FAST_SGLANG

Backend = tuple[str, Callable[..., list[Any]], Callable[[], FanOut]]
"""(name, make(urls, policies=FAST_SGLANG) -> engines, make the fan-out)."""


def _thread_engines(urls: list[str], policies: PolicyTable = FAST_SGLANG) -> list[Any]:
    return [SGLangClient(u, policies=policies) for u in urls]


@pytest.fixture(params=["threads", "ray"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """(name, make engines from URLs, make the fan-out) for each backend."""
    if request.param == "threads":
        return ("threads", _thread_engines, ThreadFanOut)
    request.getfixturevalue("ray_runtime")
    from resilience.adapters.ray import RayFanOut, ray_engines

    def make(urls: list[str], policies: PolicyTable = FAST_SGLANG) -> list[Any]:
        return list(ray_engines(urls, client_kwargs={"policies": policies}))

    return ("ray", make, RayFanOut)
