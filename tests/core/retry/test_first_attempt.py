"""The success fast path (``resilience.retry.first_attempt``) decides exactly as the ``RetryCall`` does.

A ``Retrier`` starts every call on the fast path; ``Retrier(fast_path=False)``
runs the ``RetryCall`` from the start. Each scenario runs both ways on twin
retriers (same fake clock start, same policies, fresh breakers and budgets),
without observers and with one, and compares what the caller gets (the
response or the error class and message), the delivery record (durations
included: the clock is fake), the timeouts and headers each attempt was
given, the breaker's state and counts, the budget's balance, and every event
the observer saw (call ids aside: each call takes the next one). Sync
(``run``) and async (``arun``) alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, MutableMapping
from typing import Any

import pytest

from resilience import EndpointPolicy, PolicyTable, RetryPolicy
from resilience.breaker import BreakerConfig, BreakerState
from resilience.budget import RetryBudgetConfig
from resilience.clock import FakeClock
from resilience.deadline import Deadline
from resilience.events import AttemptStarted, Event
from resilience.outcome import Delivery
from resilience.retry.retrier import Retrier
from resilience.retry.spec import AttemptResult, CallSpec

ENGINE = "http://127.0.0.1:1"
QUICK = RetryPolicy(max_attempts=3, base_s=0.01, cap_s=0.02, jitter=0)


class Boom(Exception):
    """An exception out of the attempt itself (not a transport error it reported)."""


def ok(status: int = 200) -> AttemptResult[str]:
    return AttemptResult(response=f"response {status}", status=status)


def refused() -> AttemptResult[str]:
    return AttemptResult(error=ConnectionRefusedError("refused"), delivery=Delivery.NOT_SENT, error_kind="connect_error")


def reset() -> AttemptResult[str]:
    return AttemptResult(error=ConnectionResetError("reset"), delivery=Delivery.MAYBE_APPLIED, error_kind="connection_reset")


SCENARIOS: dict[str, tuple[EndpointPolicy, list[AttemptResult[str] | BaseException]]] = {
    "success": (EndpointPolicy(retry=QUICK), [ok()]),
    "accepted status": (EndpointPolicy(retry=QUICK, accept_statuses=frozenset({404})), [ok(404)]),
    "fatal 4xx": (EndpointPolicy(retry=QUICK), [ok(400)]),
    "502 then 200": (EndpointPolicy(retry=QUICK), [ok(502), ok(200)]),
    "502 until exhausted": (EndpointPolicy(retry=QUICK), [ok(502), ok(502), ok(502)]),
    "502 until exhausted, raising": (EndpointPolicy(retry=QUICK, raise_on_exhausted=True), [ok(502), ok(502), ok(502)]),
    "refused then 200": (EndpointPolicy(retry=QUICK, deadline_s=5), [refused(), ok(200)]),
    "reset on a POST": (EndpointPolicy(idempotent=False, retry=QUICK), [reset()]),
    "reset on a GET then 200": (EndpointPolicy(retry=QUICK), [reset(), ok(200)]),
    "exception out of the attempt": (EndpointPolicy(retry=QUICK), [Boom("bad")]),
    "exception on the retry": (EndpointPolicy(retry=QUICK), [ok(503), Boom("bad")]),
    "no deadline, no timeout": (EndpointPolicy(retry=QUICK, deadline_s=None, attempt_timeout_s=None), [ok()]),
}


EXPECTED: dict[str, str] = {
    "success": "response 200",
    "accepted status": "response 404",
    "fatal 4xx": "response 400",
    "502 then 200": "response 200",
    "502 until exhausted": "response 502",
    "502 until exhausted, raising": "RetriesExhausted",
    "refused then 200": "response 200",
    "reset on a POST": "AmbiguousOutcome",
    "reset on a GET then 200": "response 200",
    "exception out of the attempt": "Boom",
    "exception on the retry": "Boom",
    "no deadline, no timeout": "response 200",
}
"""What the caller gets in each scenario: the response returned, or the class raised (both paths must give it)."""


def got(result: dict[str, Any]) -> str:
    return str(result["returned"][0]) if "returned" in result else result["raised"][0].__name__


class Script:
    """Plays results (or raises exceptions) in order, advancing the fake clock; records each attempt's timeouts."""

    def __init__(self, clock: FakeClock, steps: list[AttemptResult[str] | BaseException]) -> None:
        self.clock = clock
        self.steps = list(steps)
        self.seen: list[tuple[int, tuple[float | None, float | None], dict[str, str]]] = []

    def __call__(self, n: int, timeouts: tuple[float | None, float | None], carrier: MutableMapping[str, str]) -> AttemptResult[str]:
        self.seen.append((n, timeouts, dict(carrier)))
        self.clock.advance(0.25)
        step = self.steps.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step


def twins(clock_start: float = 1000.0, *, observed: bool = False, **kwargs: Any) -> tuple[Retrier, Retrier, list[Event], list[Event]]:
    """(fast, slow, the fast one's events, the slow one's): the same configuration, observed when ``observed``."""
    kwargs.setdefault("breaker", BreakerConfig())
    kwargs.setdefault("retry_budget", RetryBudgetConfig())
    fast_seen: list[Event] = []
    slow_seen: list[Event] = []

    def tracer(seen: list[Event]) -> Callable[[Event], None]:
        def observe(event: Event) -> None:
            seen.append(event)
            if isinstance(event, AttemptStarted):
                event.carrier["traceparent"] = f"attempt-{event.attempt}"  # what a tracing observer adds

        return observe

    def observers(seen: list[Event]) -> list[Callable[[Event], None]]:
        return [tracer(seen)] if observed else []

    fast = Retrier.from_configs(clock=FakeClock(clock_start), rng=lambda: 0.5, observers=observers(fast_seen), **kwargs)
    slow = Retrier.from_configs(clock=FakeClock(clock_start), rng=lambda: 0.5, observers=observers(slow_seen), fast_path=False, **kwargs)
    assert fast.fast_path and not slow.fast_path
    return fast, slow, fast_seen, slow_seen


def same_events(fast: list[Event], slow: list[Event]) -> bool:
    """The same events in the same order, each call's id replaced by its rank."""

    def ranked(events: list[Event]) -> list[Event]:
        ids: dict[int, int] = {}
        return [dataclasses.replace(e, call_id=ids.setdefault(e.call_id, len(ids))) if hasattr(e, "call_id") else e for e in events]  # type: ignore[call-arg]

    return ranked(fast) == ranked(slow)


def spec(policy: EndpointPolicy, request_timeout: tuple[float | None, float | None] | None = (2.0, 3.0)) -> CallSpec:
    match = PolicyTable({"GET /x": policy}).match("GET", "/x")
    return CallSpec("GET", f"{ENGINE}/x", match, ENGINE, "127.0.0.1", 1, request_timeout=request_timeout)


def outcome(retrier: Retrier, call_spec: CallSpec, steps: list[AttemptResult[str] | BaseException], mode: str) -> dict[str, Any]:
    """Everything a caller and the shared state can see of one call."""
    clock = retrier.clock
    assert isinstance(clock, FakeClock)
    script = Script(clock, steps)
    got: dict[str, Any] = {}
    try:
        if mode == "sync":
            response, records = retrier.run(call_spec, script)
        else:

            async def attempt(n: int, t: tuple[float | None, float | None], c: MutableMapping[str, str]) -> AttemptResult[str]:
                return script(n, t, c)

            response, records = asyncio.run(retrier.arun(call_spec, attempt))
        got["returned"] = (response, records)
    except Exception as exc:
        got["raised"] = (type(exc), str(exc), getattr(exc, "attempts", None))
    got["attempts"] = script.seen
    breaker = retrier.breakers.get(ENGINE) if retrier.breakers is not None else None
    if breaker is not None:
        got["breaker"] = (breaker.state, breaker._consecutive, list(breaker._window), breaker._half_open_in_flight)
    if retrier.budgets is not None:
        got["budget"] = retrier.budgets.get(ENGINE).tokens
    return got


@pytest.mark.parametrize("observed", [False, True], ids=["unobserved", "observed"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_fast_path_and_the_retry_call_give_the_same_answer_record_and_state(name: str, mode: str, observed: bool) -> None:
    policy, steps = SCENARIOS[name]
    fast, slow, fast_events, slow_events = twins(observed=observed)
    timeout = None if name == "no deadline, no timeout" else (2.0, 3.0)
    a = outcome(fast, spec(policy, timeout), list(steps), mode)
    b = outcome(slow, spec(policy, timeout), list(steps), mode)
    assert got(a) == EXPECTED[name]
    assert a == b
    assert same_events(fast_events, slow_events)
    if observed:
        assert fast_events
        assert [type(e).__name__ for e in slow_events][:2] == ["CallStarted", "AttemptStarted"]
        assert type(slow_events[-1]).__name__ == "CallEnded"
        assert all(headers == {"traceparent": f"attempt-{n}"} for n, _, headers in a["attempts"])


@pytest.mark.parametrize("observed", [False, True], ids=["unobserved", "observed"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("state", ["open", "half-open"])
def test_a_breaker_that_is_not_closed_decides_on_both_paths_alike(state: str, mode: str, observed: bool) -> None:
    """Open: refused unsent with CircuitOpen; half-open: one probe slot taken, and the success closes it."""
    config = BreakerConfig(failure_threshold=1, open_seconds=10.0)
    fast, slow, fast_events, slow_events = twins(breaker=config, retry_budget=RetryBudgetConfig(), observed=observed)
    results = []
    for retrier in (fast, slow):
        clock = retrier.clock
        assert isinstance(clock, FakeClock) and retrier.breakers is not None
        breaker = retrier.breakers.get(ENGINE)
        breaker.record_failure(breaker.admit())
        assert breaker.state is BreakerState.OPEN
        if state == "half-open":
            clock.advance(10.0)
        results.append(outcome(retrier, spec(EndpointPolicy(retry=QUICK)), [ok()], mode))
    assert results[0] == results[1]
    assert same_events(fast_events, slow_events)
    assert bool(fast_events) == observed
    if state == "open":
        assert results[0]["raised"][0].__name__ == "CircuitOpen" and results[0]["attempts"] == []
    else:
        assert results[0]["breaker"][0] is BreakerState.CLOSED


@pytest.mark.parametrize("observed", [False, True], ids=["unobserved", "observed"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_spent_outer_deadline_fails_alike_before_any_attempt(mode: str, observed: bool) -> None:
    fast, slow, fast_events, slow_events = twins(observed=observed)
    results = []
    for retrier in (fast, slow):
        with Deadline(0.0, clock=retrier.clock):
            results.append(outcome(retrier, spec(EndpointPolicy(retry=QUICK)), [ok()], mode))
    assert results[0] == results[1] and results[0]["attempts"] == [] and "raised" in results[0]
    assert same_events(fast_events, slow_events)
    assert bool(fast_events) == observed


@pytest.mark.parametrize("observed", [False, True], ids=["unobserved", "observed"])
def test_a_first_attempt_success_builds_no_retry_call(monkeypatch: pytest.MonkeyPatch, observed: bool) -> None:
    """Observed or not, a success builds no RetryCall; a failed first attempt hands over to one; ``fast_path=False``: one a call."""
    import resilience.retry.call as retry_call

    built: list[object] = []
    original: Callable[..., Any] = retry_call.RetryCall.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(retry_call.RetryCall, "__init__", counting)
    fast, slow, fast_events, _ = twins(observed=observed)
    outcome(fast, spec(EndpointPolicy(retry=QUICK)), [ok()], "sync")
    assert built == []
    assert [type(e).__name__ for e in fast_events] == (["CallStarted", "AttemptStarted", "AttemptEnded", "CallEnded"] if observed else [])
    outcome(fast, spec(EndpointPolicy(retry=QUICK)), [ok(502), ok()], "sync")
    assert len(built) == 1  # a failed first attempt hands over to a RetryCall
    outcome(slow, spec(EndpointPolicy(retry=QUICK)), [ok()], "sync")
    assert len(built) == 2
