"""``SGLangClientState``: what both SGLang clients hold and remember (keys, the pause sent, the tags released)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from resilience.adapters.driver_config import DriverConfig, Unset
from resilience.adapters.engine_http import DEFAULT_LIMIT_PER_HOST, Answer
from resilience.adapters.engine_session import own_driver_kwargs, own_policies
from resilience.adapters.engine_state import EngineClientState
from resilience.adapters.engine_steps import Steps
from resilience.adapters.sglang import liveness
from resilience.adapters.sglang.calls import (
    WEIGHT_PATHS,
    Call,
    flush_steps,
    health_result,
    key_for,
    memory_tags,
    model_info_result,
    paused_health,
    raise_if_refused,
    read_call,
)
from resilience.adapters.sglang.policies import SGLANG_POLICIES, with_memory_probe
from resilience.adapters.sglang.results import FlushResult, Health, SGLangError, SGLangWeightsReleased
from resilience.deadline import Deadline
from resilience.engine_contract import MemoryProbe
from resilience.errors import ResilienceError
from resilience.events import Observer
from resilience.outcome import AttemptRecord
from resilience.policy import PolicyTable

__all__ = ["SGLangClientState"]


class SGLangClientState(EngineClientState):
    """What both SGLang clients hold and remember: the engine, the keys, the pause sent, the tags released.

    ``base_url``: the engine (``http://127.0.0.1:30000``). ``api_key`` / ``admin_api_key``: SGLang's ``--api-key`` /
    ``--admin-api-key`` (default None), kept out of repr and errors. ``flush_deadline_s`` (default 120 s) /
    ``flush_poll_s`` (default 0.5 s): ``flush_cache``'s wait for idle and the pause between "not idle" answers.
    """

    KEYS = ("api_key", "admin_api_key")
    _policies: PolicyTable
    """The table the client's own session routes by (a call's deadline, for the liveness check)."""

    def __init__(
        self, base_url: str, *, api_key: str | None, admin_api_key: str | None, flush_deadline_s: float, flush_poll_s: float
    ) -> None:
        super().__init__(base_url)
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        self.flush_deadline_s = flush_deadline_s
        self.flush_poll_s = flush_poll_s
        self._paused_mode: str | None = None
        self._released: set[str] = set()

    def _own_kwargs(
        self, session: object, config: DriverConfig | None, policies: PolicyTable | Unset, observers: Sequence[Observer] | Unset,
        extra: Mapping[str, Any], memory_probe: MemoryProbe | None, limit_per_host: int = DEFAULT_LIMIT_PER_HOST
    ) -> dict[str, Any]:
        """Both clients' ``own_driver_kwargs`` over ``SGLANG_POLICIES`` and ``with_memory_probe``; sets ``_policies`` from them."""
        kwargs = own_driver_kwargs(
            type(self).__name__, SGLANG_POLICIES, session=session, config=config, policies=policies, observers=observers,
            extra=extra, limit_per_host=limit_per_host, memory_probe=memory_probe, with_probe=with_memory_probe,
        )
        self._policies = own_policies(kwargs, SGLANG_POLICIES)
        return kwargs

    @property
    def paused_mode(self) -> str | None:
        """The mode of the pause this client sent and has not continued, or None."""
        return self._paused_mode

    @property
    def released_tags(self) -> frozenset[str]:
        """Tags this client released and has not resumed (SGLang itself cannot tell)."""
        with self._lock:
            return frozenset(self._released)

    def _key_for(self, path: str) -> tuple[str | None, str | None]:
        """The key this route's SGLang auth level asks for, as (name, key); (None, None) = send none."""
        return key_for(path, self._api_key, self._admin_api_key)

    def _flush_steps(self, deadline_s: float | None, wait_for_idle: bool | None) -> Steps[Call | float, FlushResult]:
        """``flush_cache``'s steps: within ``deadline_s`` (None = ``flush_deadline_s``), ``flush_poll_s`` between "not idle";
        ``?timeout=`` (``wait_for_idle``) by default only when this client has not paused."""
        deadline = deadline_s if deadline_s is not None else self.flush_deadline_s
        waits = self._paused_mode is None if wait_for_idle is None else wait_for_idle
        return flush_steps(self.engine, waits, deadline, self.flush_poll_s)

    def _health_steps(self, path: str, errors: tuple[type[BaseException], ...]) -> Steps[Call, Health]:
        """``health`` / ``health_generate``: ``paused_health`` at once for an engine this client paused (its /health
        would hang), else the timed read; a transport error in ``errors`` is an unhealthy answer."""
        if self._paused_mode is not None:
            return paused_health(self.engine)
        return (yield from self._timed(read_call(path), health_result, errors))

    def _call_steps(self, call: Call) -> Steps[Call, Answer]:
        """``call`` as steps (``engine_steps``), with what both clients check around it.

        Before: refused unsent while this client has ``weights`` released (``SGLangWeightsReleased``). After: a 401/403
        raises ``SGLangAuthError``; a control call whose every attempt met a gateway status is followed by ``GET
        /model_info`` within what is left of its deadline, and raises ``EngineDied`` when that fails too (``liveness``).
        """
        self._refuse_if_released(call)
        started_at = time.monotonic()  # the call's deadline (for the liveness check) runs from here
        answer, error = yield call
        if error is not None:
            if isinstance(error, ResilienceError):  # the retry loop gave up (deadline, budget): perhaps on gateway statuses only
                records = liveness.gateway_error_records(error)
                if liveness.needs_liveness_check(call, None, records):
                    yield from self._alive_steps(call.endpoint, records, error, liveness.call_deadline(self._policies, call, started_at))
            raise error
        raise_if_refused(self.engine, answer, self._key_for(call.path)[0])
        if liveness.needs_liveness_check(call, answer.status, answer.records):
            deadline = liveness.call_deadline(self._policies, call, started_at)
            yield from self._alive_steps(answer.endpoint, answer.records, SGLangError.of(self.engine, answer), deadline)
        return answer  # type: ignore[no-any-return]  # an Answer: what the exchange step gave

    def _alive_steps(
        self, endpoint: str, records: tuple[AttemptRecord, ...], original: BaseException, deadline: Deadline
    ) -> Steps[Call, None]:
        """``GET /model_info`` within what is left of ``deadline``; ``EngineDied`` (from ``original``) when nothing answers it."""
        left = deadline.remaining()
        if left <= 0:
            return  # no time left to check: the call's own error stands
        with Deadline(left):
            answer, error = yield read_call("/model_info")
        if error is None:
            try:
                model_info_result(self.engine, raise_if_refused(self.engine, answer, self._key_for("/model_info")[0]))
            except SGLangError as exc:
                error = exc
        elif not isinstance(error, self._transport_errors()):
            raise error
        if liveness.liveness_verdict(error) is False:
            assert error is not None
            raise liveness.engine_died(self.engine, endpoint, records, original, error)

    def _transport_errors(self) -> tuple[type[BaseException], ...]:
        """What a failed exchange raises on this client's transport (and the resilience layer's own errors)."""
        raise NotImplementedError

    def _refuse_if_released(self, call: Call) -> None:
        """``SGLangWeightsReleased``, before anything is sent, for a weight call while this client has ``weights`` released."""
        if call.path in WEIGHT_PATHS and "weights" in self.released_tags:
            state = "released (this client's release_memory_occupation answered, and no resume of them since)"
            raise SGLangWeightsReleased(self.engine, call.endpoint, state, "resume_memory_occupation(['weights'])")

    def _note_paused(self, mode: str | None) -> None:
        self._paused_mode = mode

    def _note_released(self, tags: Sequence[str] | None) -> None:
        with self._lock:
            self._released.update(memory_tags(tags))

    def _note_resumed(self, tags: Sequence[str] | None) -> None:
        with self._lock:
            self._released.difference_update(memory_tags(tags))
