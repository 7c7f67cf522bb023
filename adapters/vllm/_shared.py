"""What the vLLM clients share with the SGLang clients, imported in this one place.

Generic pieces that live with the SGLang adapter today: reading a transport's
delivery record off a response (``answer_records``), checking a client's driver
keywords the same way for every client (``own_driver_kwargs``), and building
an aiohttp session with ``ResilientMiddleware`` (``aiohttp_session``). When the
SGLang modules move, only these imports change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from resilience.adapters.driver_config import DriverConfig, Unset
from resilience.adapters.sglang.async_http import aiohttp_session
from resilience.adapters.sglang.calls import answer_records, check_base_url
from resilience.adapters.sglang.own_session import own_driver_kwargs
from resilience.adapters.vllm.routes import VLLM_POLICIES
from resilience.events import Observer
from resilience.policy import PolicyTable

__all__ = ["aiohttp_session", "answer_records", "check_base_url", "driver_kwargs"]


def driver_kwargs(
    owner: str,
    *,
    session: object,
    config: DriverConfig | None,
    policies: PolicyTable | Unset,
    observers: Sequence[Observer] | Unset,
    extra: Mapping[str, Any],
    own_session_only: Sequence[str] = (),
) -> dict[str, Any]:
    """The keywords of the driver a vLLM client builds for its own session: ``own_driver_kwargs``' rules, ``VLLM_POLICIES`` by default.

    With a ``session``, any of them raises ``ConfigConflict`` naming them (they
    configure only the client's own session); with ``config``, any keyword it
    already holds does. Returns {} when a session is given.
    """
    kwargs = own_driver_kwargs(
        owner, session=session, config=config, policies=policies, observers=observers, extra=extra, own_session_only=own_session_only
    )
    if isinstance(policies, Unset) and "policies" in kwargs:
        kwargs["policies"] = VLLM_POLICIES
    return kwargs
