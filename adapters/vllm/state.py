"""``VLLMClientState``: what both vLLM clients hold (the engine, the key, the server's API) and the one rule they share to run a plan."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, TypeVar

from resilience.adapters.engine_state import EngineClientState
from resilience.adapters.engine_steps import Steps, value_of
from resilience.adapters.vllm import calls
from resilience.adapters.vllm.answers import Plan, Request, check_reply, gate, key_header, refusal_wait
from resilience.adapters.vllm.results import SleepResult, VLLMRefused, VLLMWeightsAsleep, WakeResult
from resilience.adapters.vllm.versions import VLLMApi
from resilience.deadline import Deadline

__all__ = ["VLLMClientState"]

T = TypeVar("T")


class VLLMClientState(EngineClientState):
    """The engine (``base_url``, ``engine``), the API key (kept out of repr and errors) and the server's ``VLLMApi``.

    ``api_version``: the server's release (``"0.33.0"``) when you know it, so no ``GET /version`` is sent; default None
    = asked once, before the first call whose request or answer depends on it (``Route.versioned``). ``version()`` asks
    again and keeps the new answer (after an upgrade or a restart).

    It also remembers whether it put the weights to sleep (``weights_asleep``), and refuses, unsent, a call
    that needs them meanwhile (``Route.needs_weights``: ``VLLMWeightsAsleep``).
    """

    def __init__(self, base_url: str, *, api_key: str | None, api_version: str | None) -> None:
        super().__init__(base_url)
        self._api_key = api_key
        self._api: VLLMApi | None = None if api_version is None else VLLMApi.of(api_version)
        self._asleep_level: int | None = None

    @property
    def api(self) -> VLLMApi | None:
        """The server's API as last learned (``version()``, or ``api_version=``); None before."""
        return self._api

    @property
    def weights_asleep(self) -> bool:
        """This client's ``/sleep`` at level 1 or 2 was answered, and no ``/wake_up`` that woke the weights since.

        A wake wakes them when it answers ``awake``, names no tags (every tag), or names ``weights`` alone (with
        ``scheduling``, which vLLM drops: ``v1/engine/core.py`` l.1041-1043). Other wakes leave it as it was: a wake
        naming a tag that is not asleep wakes nothing (``v1/executor/abstract.py`` l.416-422). Only what this
        client sent and read counts: a sleep whose answer was lost, or another client's, is not known here
        (``Orchestrator.weight_sync`` refuses engines whose weights it knows released, or may have).
        """
        return self._asleep_level is not None

    def _refuse_if_asleep(self, plan: Plan[Any]) -> None:
        """``VLLMWeightsAsleep``, before anything is sent, for a call that needs the weights while they sleep."""
        level = self._asleep_level
        if plan.route.needs_weights and level is not None:
            state = f"asleep (this client's POST /sleep?level={level} was answered, and no wake_up of the weights since)"
            raise VLLMWeightsAsleep(self.engine, plan.route.endpoint, state, 'wake_up(["weights"])')

    def _noted(self, result: T) -> T:
        """``result``, after folding what a sleep or wake answer says about the weights into ``weights_asleep``."""
        if isinstance(result, SleepResult):
            if result.level >= 1:
                self._asleep_level = result.level
        elif isinstance(result, WakeResult):
            named = None if result.tags is None else set(result.tags) - {"scheduling"}
            if result.awake or named is None or named == {"weights"}:
                self._asleep_level = None
        return result

    def _remember(self, api: VLLMApi) -> VLLMApi:
        self._api = api
        return api

    def _steps(self, plan: Plan[T]) -> Steps[Request | float, T]:
        """``plan`` as steps (``engine_steps``), the one rule both clients run a call by.

        A call that needs the weights while this client knows them asleep is refused first, unsent
        (``VLLMWeightsAsleep``). A versioned route learns the server's API once (``GET /version``) and is
        refused unsent when this release cannot take it (``answers.gate``). A refusal is asked again as
        its route allows (``answers.refusal_wait``, within ``plan.refusal_deadline_s``); a sleep or wake
        answer updates ``weights_asleep`` (``_noted``).
        """
        self._refuse_if_asleep(plan)
        api = None
        if plan.route.versioned:
            api = self._api if self._api is not None else self._remember((yield from self._steps(calls.version())))
            gate(self.engine, plan.route, api)
        request = plan.build(self.engine, api)
        key_sent = key_header(plan.route.path, self._api_key) is not None
        with Deadline(plan.refusal_deadline_s) as deadline:  # None: no deadline of its own
            for polls in itertools.count(1):
                answer = replace(value_of((yield request)), polls=polls)
                try:
                    check_reply(self.engine, plan.route, api, answer, key_sent=key_sent)
                    result: T = plan.read(self.engine, api, answer)
                    return self._noted(result)
                except VLLMRefused:
                    wait = refusal_wait(plan, deadline.remaining())
                    if wait is None:
                        raise
                value_of((yield wait))
        raise AssertionError("unreachable")
