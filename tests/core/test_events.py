"""``resilience.events``: the one observer interface, ``CallObserver``: plain values for each call's moments, events for the rest."""

from __future__ import annotations

import logging

import pytest

from resilience import EndpointPolicy, RetryPolicy
from resilience.events import AttemptEnded, AttemptStarted, CallEnded, CallObserver, CallStarted, Event, RetryScheduled, call_observer
from resilience.outcome import CallOutcome, Outcome
from resilience.retry.retrier import Retrier
from resilience.testing.clock import FakeClock
from tests.core.retry.scripts import ENGINE, Script, spec, status

POLICY = EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0.1, cap_s=0.1, jitter=0))


class Values(CallObserver):
    """Takes the per-call moments as values; records every event it is handed."""

    def __init__(self) -> None:
        self.moments: list[tuple[object, ...]] = []
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def call_started(self, call_id: int, method: str, endpoint: str, engine: str, deadline_s: float | None) -> None:
        self.moments.append(("call_started", method, endpoint, engine))

    def attempt_started(self, call_id: int, attempt: int, *args: object) -> None:  # type: ignore[override]
        self.moments.append(("attempt_started", attempt))

    def attempt_ended(self, call_id: int, attempt: int, method: str, endpoint: str, engine: str, status: int | None, *rest: object) -> None:  # type: ignore[override]
        self.moments.append(("attempt_ended", attempt, status, rest[0]))

    def call_ended(self, call_id: int, method: str, endpoint: str, engine: str, outcome: CallOutcome, *rest: object) -> None:  # type: ignore[override]
        self.moments.append(("call_ended", outcome, rest[0], rest[1]))  # status, attempts


def run(observer: object) -> None:
    retrier = Retrier(clock=FakeClock(), observers=[observer])  # type: ignore[list-item]
    response, records = retrier.run(spec(POLICY, "GET"), Script(status(502), status(200)))
    assert response == "resp200" and len(records) == 2


def test_an_observer_of_values_gets_each_moment_as_values_and_no_per_call_event() -> None:
    """502 then 200: the four moments in order as values; ``__call__`` hears only the retry, never a per-call event."""
    obs = Values()
    run(obs)
    assert obs.moments == [
        ("call_started", "GET", "GET /x", ENGINE),
        ("attempt_started", 0),
        ("attempt_ended", 0, 502, Outcome.RETRYABLE),
        ("attempt_started", 1),
        ("attempt_ended", 1, 200, Outcome.SUCCESS),
        ("call_ended", CallOutcome.RETRIED_SUCCESS, 200, 2),
    ]
    assert [type(e) for e in obs.events] == [RetryScheduled]


def test_a_plain_callable_hears_every_moment_as_an_event() -> None:
    seen: list[Event] = []
    run(seen.append)
    kinds = [type(e) for e in seen]
    assert kinds == [CallStarted, AttemptStarted, AttemptEnded, RetryScheduled, AttemptStarted, AttemptEnded, CallEnded]
    ended = seen[-1]
    assert isinstance(ended, CallEnded) and ended.attempts == 2 and ended.outcome is CallOutcome.RETRIED_SUCCESS
    assert isinstance(seen[2], AttemptEnded) and seen[2].error_type == "502"  # a failed status names itself


def test_call_observer_wraps_a_callable_once_and_keeps_an_observer() -> None:
    obs = Values()
    assert call_observer(obs) is obs
    seen: list[Event] = []
    wrapped = call_observer(seen.append)
    wrapped.call_started(1, "GET", "GET /x", ENGINE, None)
    assert seen == [CallStarted(call_id=1, method="GET", endpoint="GET /x", engine=ENGINE, deadline_s=None)]


def test_replay_hands_a_per_call_event_to_its_method() -> None:
    """A per-call event made by another producer reaches an observer of values through ``replay``; other events go to ``__call__``."""
    obs = Values()
    obs.replay(CallStarted(call_id=1, method="POST", endpoint="POST /x", engine=ENGINE, deadline_s=2.0))
    retry = RetryScheduled(call_id=1, attempt=0, endpoint="POST /x", engine=ENGINE, reason="status_502", delay_s=0.1)
    obs.replay(retry)
    assert obs.moments == [("call_started", "POST", "POST /x", ENGINE)] and obs.events == [retry]


def test_an_observer_that_raises_is_logged_and_the_call_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(CallObserver):
        def attempt_ended(self, *args: object) -> None:  # type: ignore[override]
            raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="resilience.events"):
        run(Broken())
    assert caplog.text.count("failed on attempt_ended") == 2


def test_a_moment_an_observer_does_not_hear_is_not_called_and_the_others_are() -> None:
    """``hears`` is asked once per ``Retrier``: a moment answered False is never called; the others come as before."""

    class Deaf(Values):
        asked: list[str] = []  # noqa: RUF012

        def hears(self, moment: str) -> bool:
            self.asked.append(moment)
            return moment in ("attempt_ended", "call_ended")

    obs = Deaf()
    retrier = Retrier(clock=FakeClock(), observers=[obs])
    for _ in range(2):
        retrier.run(spec(POLICY, "GET"), Script(status(502), status(200)))
    assert sorted(obs.asked) == ["attempt_ended", "attempt_started", "call_ended", "call_started"]  # once, at build
    once = [("attempt_ended", 0, 502, Outcome.RETRYABLE), ("attempt_ended", 1, 200, Outcome.SUCCESS)]
    once += [("call_ended", CallOutcome.RETRIED_SUCCESS, 200, 2)]
    assert obs.moments == once * 2
    assert [type(e) for e in obs.events] == [RetryScheduled] * 2  # the other events still come



def test_an_attempt_nobody_hears_start_gets_no_carrier_of_its_own() -> None:
    """With no observer hearing ``attempt_started``, the driver is handed the shared empty ``NO_HEADERS`` (nothing to copy)."""
    from collections.abc import MutableMapping

    from resilience.retry.call import NO_HEADERS
    from resilience.retry.spec import AttemptResult, Timeouts

    class Deaf(Values):
        def hears(self, moment: str) -> bool:
            return moment != "attempt_started"

    carriers: list[object] = []
    script = Script(status(502), status(200))

    def send(n: int, timeouts: Timeouts, carrier: MutableMapping[str, str]) -> AttemptResult[str]:
        carriers.append(carrier)
        return script(n, timeouts, carrier)

    Retrier(clock=FakeClock(), observers=[Deaf()]).run(spec(POLICY, "GET"), send)
    assert len(carriers) == 2 and all(c is NO_HEADERS for c in carriers)
    heard: list[object] = []
    once = Script(status(200))

    def send_heard(n: int, timeouts: Timeouts, carrier: MutableMapping[str, str]) -> AttemptResult[str]:
        heard.append(carrier)
        return once(n, timeouts, carrier)

    Retrier(clock=FakeClock(), observers=[Values()]).run(spec(POLICY, "GET"), send_heard)
    assert len(heard) == 1 and heard[0] is not NO_HEADERS  # one who hears it gets a carrier to write into
