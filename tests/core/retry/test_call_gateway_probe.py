"""``resilience.retry.call``: a gateway status on a non-idempotent entry asks its probe before anything is re-sent (no sockets)."""

from __future__ import annotations

from collections.abc import MutableMapping

import pytest

from resilience import AmbiguousOutcome, EndpointPolicy, PolicyTable, RetryPolicy
from resilience.events import Event, ProbeCompleted
from resilience.outcome import Delivery
from resilience.policy import ProbeAnswer, ProbeContext
from resilience.retry.retrier import Retrier
from resilience.retry.spec import AttemptResult, CallSpec
from resilience.testing.clock import FakeClock

ENGINE = "http://127.0.0.1:1"
FAST = RetryPolicy(max_attempts=3, base_s=0, cap_s=0)


class Script:
    """Plays AttemptResults in order; counts the attempts sent."""

    def __init__(self, *results: AttemptResult[str]) -> None:
        self.results = list(results)
        self.sent = 0

    def __call__(self, n: int, timeouts: tuple[float | None, float | None], carrier: MutableMapping[str, str]) -> AttemptResult[str]:
        self.sent += 1
        return self.results.pop(0)


class Asked:
    """A probe that answers ``answers`` in turn and keeps the contexts it was given."""

    def __init__(self, *answers: ProbeAnswer) -> None:
        self.answers = list(answers)
        self.contexts: list[ProbeContext] = []

    def __call__(self, context: ProbeContext) -> ProbeAnswer:
        self.contexts.append(context)
        return self.answers.pop(0)


def status(code: int) -> AttemptResult[str]:
    return AttemptResult(response=f"resp{code}", status=code)


def run(policy: EndpointPolicy, script: Script, *, key: str = "POST /x", events: list[Event] | None = None) -> str:
    table = PolicyTable({key: policy}) if key else PolicyTable(default=lambda _m: policy)
    match = table.match("POST", "/x")
    call = CallSpec("POST", f"{ENGINE}/x", match, ENGINE, "127.0.0.1", 1, body=b'{"tags": null}')
    retrier = Retrier(clock=FakeClock(), breakers=None, budgets=None, observers=[events.append] if events is not None else [])
    response, _records = retrier.run(call, script, on_probe_done=lambda: "confirmed")
    return response


def policy(probe: Asked | None, *, resend_statuses: bool) -> EndpointPolicy:
    return EndpointPolicy(
        retry=FAST, idempotent=False, retry_statuses_if_not_idempotent=resend_statuses, on_ambiguous=probe if probe else "raise"
    )


@pytest.mark.parametrize("resend_statuses", [True, False])
def test_done_after_a_502_returns_as_applied_without_a_resend(resend_statuses: bool) -> None:
    """"done": the driver's stand-in is returned, one attempt sent, the probe told the status and the body."""
    probe, events = Asked(ProbeAnswer.DONE), list[Event]()
    script = Script(status(502))
    assert run(policy(probe, resend_statuses=resend_statuses), script, events=events) == "confirmed"
    assert script.sent == 1
    (context,) = probe.contexts
    assert (context.status, context.error, context.body, context.engine, context.attempt) == (502, None, b'{"tags": null}', ENGINE, 0)
    assert [e.answer for e in events if isinstance(e, ProbeCompleted)] == ["done"]


@pytest.mark.parametrize("resend_statuses", [True, False])
def test_not_done_after_a_503_re_sends(resend_statuses: bool) -> None:
    """"not done" proves the attempt was not applied: re-sent, even where statuses alone are not re-sent."""
    script = Script(status(503), status(200))
    assert run(policy(Asked(ProbeAnswer.NOT_DONE), resend_statuses=resend_statuses), script) == "resp200"
    assert script.sent == 2


def test_unknown_falls_back_to_the_entrys_own_choice() -> None:
    """"unknown": re-sent where the entry re-sends statuses (the seed's trade-off), the status handed back where it does not."""
    script = Script(status(502), status(200))
    assert run(policy(Asked(ProbeAnswer.UNKNOWN, ProbeAnswer.UNKNOWN), resend_statuses=True), script) == "resp200"
    assert script.sent == 2
    script = Script(status(504))
    assert run(policy(Asked(ProbeAnswer.UNKNOWN), resend_statuses=False), script) == "resp504"
    assert script.sent == 1


def test_probe_on_every_gateway_status_until_attempts_run_out() -> None:
    """Each gateway status is judged before the next attempt; the last one, still unknown, is handed back."""
    probe = Asked(ProbeAnswer.UNKNOWN, ProbeAnswer.NOT_DONE, ProbeAnswer.UNKNOWN)
    script = Script(status(502), status(502), status(502))
    assert run(policy(probe, resend_statuses=True), script) == "resp502"
    assert script.sent == 3 and [c.attempt for c in probe.contexts] == [0, 1, 2]


def test_no_probe_where_none_is_set_the_entry_is_idempotent_or_the_status_is_not_a_gateways() -> None:
    """Without a probe, on an idempotent entry, on the default policy, or on a 500: the probe is never asked."""
    script = Script(status(502), status(200))
    assert run(policy(None, resend_statuses=True), script) == "resp200"
    probe = Asked()
    idempotent = EndpointPolicy(retry=FAST, idempotent=True, on_ambiguous=probe)
    assert run(idempotent, Script(status(502), status(200))) == "resp200"
    assert run(policy(probe, resend_statuses=True), Script(status(502), status(200)), key="") == "resp200"
    assert run(policy(probe, resend_statuses=True), Script(status(500))) == "resp500"
    assert probe.contexts == []


def test_an_ambiguous_failure_still_raises_on_unknown() -> None:
    """A read timeout (no status) answered "unknown" raises AmbiguousOutcome, as before."""
    lost: AttemptResult[str] = AttemptResult(error=TimeoutError("read"), delivery=Delivery.AMBIGUOUS, error_kind="read_timeout")
    with pytest.raises(AmbiguousOutcome):
        run(policy(Asked(ProbeAnswer.UNKNOWN), resend_statuses=True), Script(lost))
