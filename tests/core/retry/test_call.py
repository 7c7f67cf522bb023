"""``resilience.retry.call``: ``RetryCall``'s decisions and the rules written beside them.

No sockets: scripted attempt results (``tests/core/retry/scripts.py``) and a
fake clock. First the decision object stepped by hand, then the rules on
attempts, deadlines, ambiguity and errors driven through ``Retrier.run`` (the
driver adds nothing to them: ``test_retrier.py`` proves ``arun`` decides
alike). The connect window, the gateway probe and the breaker's slots have
files of their own (``test_call_*.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, MutableMapping

import pytest

import resilience
import resilience.retry.call as call_module
from resilience import AmbiguousOutcome, DeadlineExceeded, EndpointPolicy, PolicyTable, RetryPolicy
from resilience.events import CallEnded, Event, RetryScheduled
from resilience.outcome import CallOutcome, Delivery, attempts_of
from resilience.policy import ProbeAnswer
from resilience.retry.call import AskProbe, Raise, Return, Send, Wait
from resilience.retry.retrier import Retrier
from resilience.retry.spec import AttemptResult, CallSpec
from resilience.testing.clock import FakeClock
from tests.core.retry.scripts import ENGINE, Script, lost, refused, spec, status


def test_retry_call_decides_without_io() -> None:
    """502 then 200: Send, Wait (with the 502 to release), Send, Return; the sleep is the driver's to do."""
    clock = FakeClock()
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0.5, cap_s=1, jitter=0), deadline_s=30, attempt_timeout_s=5)
    call = Retrier(clock=clock).begin(spec(policy))
    first = call.next_step()
    assert isinstance(first, Send) and first.attempt == 0 and first.timeouts == (5, 5)
    wait = call.attempt_done(status(502))
    assert isinstance(wait, Wait) and wait.discard == "resp502" and wait.delay_s == pytest.approx(0.5)
    assert clock.sleeps == []  # the core never sleeps
    second = call.next_step()
    assert isinstance(second, Send) and second.attempt == 1
    done = call.attempt_done(status(200))
    assert isinstance(done, Return) and done.response == "resp200" and [a.status for a in done.attempts] == [502, 200]
    assert call.ended


def test_retry_call_asks_the_probe_and_takes_its_answer() -> None:
    """A lost non-idempotent attempt with a probe: AskProbe, then "not done" allows one more Send."""
    policy = EndpointPolicy(idempotent=False, on_ambiguous=lambda ctx: ProbeAnswer.NOT_DONE, retry=RetryPolicy(base_s=0, cap_s=0))
    call = Retrier(clock=FakeClock()).begin(spec(policy))
    call.next_step()
    probe = call.attempt_done(lost())
    assert isinstance(probe, AskProbe) and probe.context.endpoint == "POST /x" and probe.context.attempt == 0
    assert isinstance(call.probe_answered(probe.probe(probe.context)), Wait)
    call.next_step()
    probe = call.attempt_done(lost())
    assert isinstance(probe, AskProbe)
    end = call.probe_answered("not an answer")
    assert isinstance(end, Raise) and isinstance(end.error, resilience.AmbiguousOutcome)


@pytest.mark.parametrize("first", ["refused", "502"])
def test_a_backoff_that_oversleeps_the_deadline_ends_as_a_wait_that_did_not_fit(first: str) -> None:
    """A busy machine sleeps past the deadline: a refusal still ends as the transport's own error with its attempts,
    a 502 as DeadlineExceeded, the same endings as when the next wait does not fit (CI once saw a refusal end as
    "deadline exceeded before attempt")."""
    clock = FakeClock()
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=5, base_s=0.1, cap_s=0.1), attempt_timeout_s=1.0, deadline_s=1.0)
    call = Retrier(clock=clock).begin(spec(policy, "GET"))
    assert isinstance(call.next_step(), Send)
    first_result = refused() if first == "refused" else status(502)
    wait = call.attempt_done(first_result)
    assert isinstance(wait, Wait) and 0 < wait.delay_s < 1.0
    clock.advance(1.5)  # the backoff sleep ran past the deadline
    end = call.next_step()
    assert isinstance(end, Raise) and call.ended
    if first == "refused":
        assert end.error is first_result.error and len(end.error.attempts) == 1  # type: ignore[attr-defined]
    else:
        assert isinstance(end.error, DeadlineExceeded) and "before attempt" in str(end.error)


def test_attempt_done_without_a_send_is_refused() -> None:
    call = Retrier(clock=FakeClock()).begin(spec(EndpointPolicy()))
    with pytest.raises(RuntimeError, match="without a Send"):
        call.attempt_done(status(200))


def test_502_502_200_sleeps_within_backoff_bounds() -> None:
    """Two 502s then 200: one call, three attempts, each sleep within its full-jitter ceiling."""
    clock = FakeClock()
    seen: list[Event] = []
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=5, base_s=0.5, cap_s=4, multiplier=2), deadline_s=30, attempt_timeout_s=5)
    r = Retrier(clock=clock, observers=[seen.append], rng=lambda: 0.75)
    resp, records = r.run(spec(policy), Script(status(502), status(502), status(200)))
    assert resp == "resp200"
    assert [a.status for a in records] == [502, 502, 200]
    assert clock.sleeps == [pytest.approx(0.375), pytest.approx(0.75)]
    assert [e.reason for e in seen if isinstance(e, RetryScheduled)] == ["status_502", "status_502"]
    ended = [e for e in seen if isinstance(e, CallEnded)]
    assert ended[0].outcome is CallOutcome.RETRIED_SUCCESS and ended[0].attempts == 3


def test_exhausted_returns_last_response_unless_policy_raises() -> None:
    """After the last attempt the caller gets the final response, like plain requests."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0, cap_s=0))
    resp, records = Retrier(clock=FakeClock()).run(spec(policy), Script(status(503), status(503)))
    assert resp == "resp503" and len(records) == 2
    strict = EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0, cap_s=0), raise_on_exhausted=True)
    with pytest.raises(resilience.RetriesExhausted) as info:
        Retrier(clock=FakeClock()).run(spec(strict), Script(status(503), status(503)))
    assert info.value.last_status == 503 and len(info.value.attempts) == 2


def test_attempt_timeout_capped_by_remaining_deadline() -> None:
    """Each attempt gets min(attempt_timeout, remaining deadline)."""
    clock = FakeClock()
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=1, cap_s=1, jitter=0), attempt_timeout_s=2, deadline_s=2.5)
    script = Script(status(502), status(200))
    Retrier(clock=clock).run(spec(policy), script)
    assert script.timeouts[0] == (2, 2)
    assert script.timeouts[1] == (pytest.approx(1.5), pytest.approx(1.5))


def test_retry_after_past_deadline_stops_at_once() -> None:
    """A Retry-After longer than the time left raises DeadlineExceeded carrying the last status, without sleeping."""
    clock = FakeClock()
    policy = EndpointPolicy(deadline_s=5, attempt_timeout_s=1)
    with pytest.raises(DeadlineExceeded) as info:
        Retrier(clock=clock).run(spec(policy, "GET"), Script(status(503, retry_after=30)))
    assert info.value.last_status == 503
    assert clock.sleeps == []


def test_read_timeout_on_non_idempotent_is_ambiguous() -> None:
    """An ambiguous failure on a non-idempotent endpoint is never re-sent."""
    script = Script(AttemptResult(error=TimeoutError("read"), delivery=Delivery.AMBIGUOUS, error_kind="read_timeout"))
    with pytest.raises(AmbiguousOutcome) as info:
        Retrier(clock=FakeClock()).run(spec(EndpointPolicy(idempotent=False)), script)
    assert len(info.value.attempts) == 1 and script.results == []


def test_probe_decides_ambiguous_outcome() -> None:
    """A probe answering not_done allows one more send; done returns the probe's response."""
    answers = iter([ProbeAnswer.NOT_DONE, ProbeAnswer.DONE])
    policy = EndpointPolicy(idempotent=False, on_ambiguous=lambda ctx: next(answers))
    maybe: AttemptResult[str] = AttemptResult(error=TimeoutError(), delivery=Delivery.AMBIGUOUS, error_kind="read_timeout")
    resp, records = Retrier(clock=FakeClock()).run(spec(policy), Script(maybe, maybe), on_probe_done=lambda: "probed")
    assert resp == "probed" and len(records) == 2


def test_not_sent_failure_retried_for_post() -> None:
    """A failure before sending (connection refused) is retried for any method."""
    refused: AttemptResult[str] = AttemptResult(error=ConnectionRefusedError(), delivery=Delivery.NOT_SENT, error_kind="connect_error")
    resp, _ = Retrier(clock=FakeClock()).run(spec(EndpointPolicy(idempotent=False)), Script(refused, status(200)))
    assert resp == "resp200"


def test_last_transport_error_is_reraised_with_attempts() -> None:
    """When every attempt failed in transport, the caller gets the transport's own last error."""
    reset = ConnectionResetError("nope")
    fail: AttemptResult[str] = AttemptResult(error=reset, delivery=Delivery.AMBIGUOUS, error_kind="connection_reset")
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0, cap_s=0))
    with pytest.raises(ConnectionResetError) as info:
        Retrier(clock=FakeClock()).run(spec(policy, "GET"), Script(fail, fail))
    assert len(info.value.attempts) == 2  # type: ignore[attr-defined]


def test_failures_before_sending_retried_until_the_deadline_not_max_attempts() -> None:
    """max_attempts bounds attempts that reached the server: refusals are retried with backoff until the deadline."""
    clock = FakeClock()
    retry = RetryPolicy(max_attempts=2, base_s=0.1, cap_s=0.1, jitter=0)
    policy = EndpointPolicy(idempotent=False, retry=retry, deadline_s=1.0, attempt_timeout_s=1)
    script = Script(*[refused() for _ in range(6)], status(200))
    resp, records = Retrier(clock=clock).run(spec(policy), script)
    assert resp == "resp200" and len(records) == 7
    assert [r.delivery for r in records[:6]] == [Delivery.NOT_SENT] * 6
    with pytest.raises(ConnectionRefusedError) as info:  # the deadline ends it on a refusal: the refusal itself
        Retrier(clock=clock).run(spec(policy), Script(*[refused() for _ in range(50)]))
    assert 9 <= len(info.value.attempts) <= 11  # type: ignore[attr-defined]  # 0.1 s apart within 1 s


def test_sent_attempts_still_bounded_by_max_attempts_among_refusals() -> None:
    """Refusals in between do not extend the count of attempts that reached the server."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0, cap_s=0), deadline_s=5, attempt_timeout_s=1)
    resp, records = Retrier(clock=FakeClock()).run(spec(policy, "GET"), Script(status(502), refused(), refused(), status(503)))
    assert resp == "resp503" and [r.status for r in records] == [502, None, None, 503]


def test_without_any_deadline_refusals_count_against_max_attempts() -> None:
    """A call with no deadline at all cannot retry refusals forever: they count as attempts."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0, cap_s=0), deadline_s=None, attempt_timeout_s=None)
    with pytest.raises(ConnectionRefusedError) as info:
        Retrier(clock=FakeClock()).run(spec(policy), Script(refused(), refused(), refused(), status(200)))
    assert len(info.value.attempts) == 3  # type: ignore[attr-defined]


def test_unreplayable_body_gets_one_attempt() -> None:
    """A body that cannot be sent twice: one attempt, and the caller gets the 502 it would have seen."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=4, base_s=0, cap_s=0))
    match = PolicyTable({"POST /x": policy}).match("POST", "/x")
    one = CallSpec("POST", f"{ENGINE}/x", match, ENGINE, "127.0.0.1", 1, replayable=False)
    script = Script(status(502), status(200))
    resp, records = Retrier(clock=FakeClock()).run(one, script)
    assert resp == "resp502" and len(records) == 1 and len(script.results) == 1


def test_testing_mode_caps_attempts_and_skips_sleeps() -> None:
    """resilience.set_testing(True) removes backoff sleeps and caps attempts."""
    clock = FakeClock()
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=5))
    with resilience.set_testing(True, attempts=2):
        resp, records = Retrier(clock=clock).run(spec(policy, "GET"), Script(status(502), status(502), status(200)))
    assert resp == "resp502" and len(records) == 2 and clock.sleeps == []


def test_outer_deadline_caps_call() -> None:
    """A Deadline in context caps the call's own deadline."""
    clock = FakeClock()
    policy = EndpointPolicy(deadline_s=60, attempt_timeout_s=10)
    script = Script(status(200))
    with resilience.Deadline(3, clock=clock):
        Retrier(clock=clock).run(spec(policy, "GET"), script)
    assert script.timeouts[0] == (pytest.approx(3), pytest.approx(3))


def test_testing_mode_counts_refusals_against_max_attempts() -> None:
    """Testing mode has no sleeps, so refusals count as attempts instead of spinning until the deadline."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=3), deadline_s=30, attempt_timeout_s=1)
    with resilience.set_testing(True), pytest.raises(ConnectionRefusedError) as info:
        Retrier(clock=FakeClock()).run(spec(policy), Script(*[refused() for _ in range(10)]))
    assert len(info.value.attempts) == 3  # type: ignore[attr-defined]


class _Unretried(Exception):
    """A driver's error raised out of an attempt, never retried (a TLS failure, say)."""


def _raise_after(*results: AttemptResult[str], error: BaseException) -> Callable[..., AttemptResult[str]]:
    """An attempt function that plays ``results``, then raises ``error``."""
    script = list(results)

    def attempt(n: int, timeouts: tuple[float | None, float | None], carrier: MutableMapping[str, str]) -> AttemptResult[str]:
        if not script:
            raise error
        return script.pop(0)

    return attempt


@pytest.mark.parametrize("proof", [False, True])
def test_an_error_raised_out_of_an_attempt_carries_the_calls_record(proof: bool) -> None:
    """A 502, then the attempt raises: the error carries both attempts; the raised one NOT_SENT only on the driver's proof."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0, cap_s=0), deadline_s=30)
    error = _Unretried("certificate verify failed")
    script = _raise_after(status(502), error=error)
    with pytest.raises(_Unretried):
        Retrier(clock=FakeClock()).run(spec(policy, "GET"), script, never_sent=lambda e: proof)
    records = attempts_of(error)
    assert records is not None and [(r.status, r.delivery) for r in records] == [
        (502, Delivery.RESPONDED),
        (None, Delivery.NOT_SENT if proof else Delivery.AMBIGUOUS),
    ]
    assert records[-1].error_type == "_Unretried"


def test_an_interrupt_gets_no_record_and_a_failing_proof_proves_nothing() -> None:
    """KeyboardInterrupt is not the transport's answer (no record); a never_sent predicate that raises counts as no proof."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0, cap_s=0), deadline_s=30)
    interrupt = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        Retrier(clock=FakeClock()).run(spec(policy, "GET"), _raise_after(error=interrupt), never_sent=lambda e: True)
    assert attempts_of(interrupt) is None

    def broken(_e: BaseException) -> bool:
        raise RuntimeError("no proof")

    error = _Unretried("x")
    with pytest.raises(_Unretried):
        Retrier(clock=FakeClock()).run(spec(policy, "GET"), _raise_after(error=error), never_sent=broken)
    assert [r.delivery for r in attempts_of(error) or ()] == [Delivery.AMBIGUOUS]


def test_attempts_of_reads_the_error_then_its_response_and_nothing_else() -> None:
    """The record on the error, else on its response (an attribute, or httpx's extensions); empty or foreign values are None."""
    from resilience.outcome import AttemptRecord, Outcome

    record = (AttemptRecord(0, 503, Outcome.RETRYABLE, Delivery.RESPONDED, None, 0.1),)

    class Response:
        def __init__(self, **attrs: object) -> None:
            self.__dict__.update(attrs)

    def error(**attrs: object) -> Exception:
        exc = Exception("x")
        exc.__dict__.update(attrs)
        return exc

    assert attempts_of(error(attempts=record)) == record
    assert attempts_of(error(response=Response(attempts=record))) == record
    assert attempts_of(error(response=Response(extensions={"attempts": record}))) == record
    assert attempts_of(error(attempts=(), response=Response(attempts=record))) == record
    for empty in (error(), error(attempts=()), error(attempts=3), error(attempts=("x",)), error(response=Response())):
        assert attempts_of(empty) is None
    caused = error()
    caused.__cause__ = error(attempts=record)
    assert attempts_of(caused) is None  # a record belongs to the error it was written on


def test_the_loop_in_the_docstring_is_the_one_run_uses() -> None:
    """``resilience.retry.call``'s docstring shows ``Retrier.run``'s loop: each of its code lines is a line of ``run``, in order."""
    doc = call_module.__doc__ or ""
    block = doc.split("::\n", 1)[1].split("\n\n", 1)[0]
    shown = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    shown = [line.replace("clock.sleep", "self.clock.sleep") for line in shown if line]
    assert len(shown) > 10, shown
    body = [line.strip() for line in inspect.getsource(Retrier.run).splitlines()]
    at = 0
    for line in shown[1:]:  # the first line starts the call
        assert line in body[at:], f"{line!r} is not in Retrier.run (after line {at})"
        at = body.index(line, at) + 1
