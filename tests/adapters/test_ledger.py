"""``LedgerRetrier`` without sockets: calls that repeat a failed one start from what it left (scripted transport, fake clock)."""

from __future__ import annotations

from collections.abc import MutableMapping

import pytest

from resilience import AmbiguousOutcome, EndpointPolicy, PolicyTable, RetryPolicy
from resilience.adapters.ledger import AttemptLedger, LedgerRetrier
from resilience.budget import RetryBudgetConfig, RetryBudgets
from resilience.errors import ConfigError, DeadlineExceeded, RetriesExhausted, RetryBudgetExhausted
from resilience.outcome import Delivery, attempts_of
from resilience.policy import ProbeAnswer, ProbeContext
from resilience.retry.spec import AttemptResult, CallSpec
from resilience.testing.clock import FakeClock

ENGINE = "http://127.0.0.1:1"
QUICK = RetryPolicy(max_attempts=3, base_s=0.0, cap_s=0.0)
IDEMPOTENT = EndpointPolicy(retry=QUICK, idempotent=True, deadline_s=30)
RELEASE = EndpointPolicy(retry=QUICK, idempotent=False, retry_statuses_if_not_idempotent=True, deadline_s=30)


def spec(policy: EndpointPolicy, path: str = "/x") -> CallSpec:
    match = PolicyTable({f"POST {path}": policy}).match("POST", path)
    return CallSpec("POST", f"{ENGINE}{path}", match, ENGINE, "127.0.0.1", 1)


class Transport:
    """Answers every attempt with ``result``; counts the sends."""

    def __init__(self, result: AttemptResult[str]) -> None:
        self.result = result
        self.sends = 0

    def __call__(self, n: int, timeouts: tuple[float | None, float | None], carrier: MutableMapping[str, str]) -> AttemptResult[str]:
        self.sends += 1
        return self.result


class Script:
    """Answers the attempts with ``results`` in turn (the last one for ever), each taking a second of ``clock``."""

    def __init__(self, results: list[AttemptResult[str]], clock: FakeClock) -> None:
        self.results, self.clock = results, clock
        self.sends = 0

    def __call__(self, n: int, timeouts: tuple[float | None, float | None], carrier: MutableMapping[str, str]) -> AttemptResult[str]:
        self.sends += 1
        self.clock.advance(1.0)
        return self.results[min(self.sends, len(self.results)) - 1]


def bad_gateway() -> AttemptResult[str]:
    return AttemptResult(response="502", status=502)


def lost() -> AttemptResult[str]:
    return AttemptResult(error=TimeoutError("read"), delivery=Delivery.AMBIGUOUS, error_kind="read_timeout")


def retrier(clock: FakeClock, **kwargs: object) -> LedgerRetrier:
    return LedgerRetrier(AttemptLedger(30.0, clock=clock), clock=clock, **kwargs)  # type: ignore[arg-type]


def test_a_repeated_release_gets_what_the_last_one_left() -> None:
    """Three calls of an always-502 release (a re-send can hurt) send max_attempts in all; the later ones are refused before sending."""
    clock = FakeClock()
    r, transport = retrier(clock), Transport(bad_gateway())
    assert r.run(spec(RELEASE), transport)[0] == "502"
    for _ in range(2):
        with pytest.raises(RetriesExhausted, match="already spent by earlier calls"):
            r.run(spec(RELEASE), transport)
    assert transport.sends == 3


def test_a_harmless_call_goes_on_past_its_attempts() -> None:
    """An idempotent endpoint (a pause): a streak of 502s longer than max_attempts is ridden out in further rounds."""
    clock = FakeClock()
    r = retrier(clock)
    transport = Script([bad_gateway()] * 5 + [AttemptResult(response="200", status=200)], clock)
    assert r.run(spec(IDEMPOTENT), transport)[0] == "200"
    assert transport.sends == 6


def test_a_harmless_call_and_its_repeats_are_bounded_by_the_deadline() -> None:
    """Always 502, one second per attempt: rounds go on until deadline_s (30 s) from the first failure, which ends the call
    (DeadlineExceeded, naming the last 502); the framework's repeat after that is refused unsent."""
    clock = FakeClock()
    r, transport = retrier(clock), Script([bad_gateway()], clock)
    with pytest.raises(DeadlineExceeded, match="status_502"):
        r.run(spec(IDEMPOTENT), transport)
    assert 28 <= transport.sends <= 31
    sent = transport.sends
    with pytest.raises(DeadlineExceeded, match="past the endpoint's deadline_s=30"):
        r.run(spec(IDEMPOTENT), transport)
    assert transport.sends == sent


def test_a_harmless_call_is_bounded_by_the_retry_budget() -> None:
    """The rounds take retry-budget tokens: with few, the call returns its last 502 long before its deadline."""
    clock = FakeClock()
    budgets = RetryBudgets(RetryBudgetConfig(ratio=0.0, min_retries_per_second=0.0, max_tokens=5.0), clock=clock)
    r, transport = retrier(clock, budgets=budgets), Script([bad_gateway()], clock)
    assert r.run(spec(IDEMPOTENT), transport)[0] == "502"
    assert transport.sends <= 6


def test_a_release_the_probe_proves_not_applied_gets_attempts_of_its_own() -> None:
    """After 502s the probe proves "not applied": the repeat cannot be a second release, so it is not cut to what was left."""
    clock = FakeClock()
    policy = EndpointPolicy(
        retry=QUICK, idempotent=False, retry_statuses_if_not_idempotent=True, deadline_s=30, on_ambiguous=lambda _c: ProbeAnswer.NOT_DONE
    )
    r = retrier(clock)
    transport = Script([bad_gateway()] * 5 + [AttemptResult(response="200", status=200)], clock)
    assert r.run(spec(policy), transport)[0] == "200"
    assert transport.sends == 6  # not cut at 3: the probe proved each 502 left nothing applied


def test_a_success_clears_and_the_window_forgets() -> None:
    """A repeat that succeeds on the attempts left starts the count afresh; so does a call after the window."""
    clock = FakeClock()
    r = retrier(clock)
    two = EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0, cap_s=0), idempotent=False, retry_statuses_if_not_idempotent=True)
    r.run(spec(two), Transport(bad_gateway()))
    r.run(spec(RELEASE, "/y"), Transport(bad_gateway()))
    ok = Transport(AttemptResult(response="200", status=200))
    assert r.run(spec(RELEASE), ok)[0] == "200" and ok.sends == 1  # one attempt was left of three
    again = Transport(bad_gateway())
    r.run(spec(RELEASE), again)
    assert again.sends == 3
    with pytest.raises(RetriesExhausted):
        r.run(spec(RELEASE, "/y"), Transport(bad_gateway()))
    clock.advance(31.0)
    later = Transport(bad_gateway())
    r.run(spec(RELEASE, "/y"), later)
    assert later.sends == 3


def test_the_first_attempt_of_a_repeat_takes_a_budget_token() -> None:
    """A repeat's first attempt is a retry for the engine's budget: with none left it is refused."""
    clock = FakeClock()
    budgets = RetryBudgets(RetryBudgetConfig(ratio=0.0, min_retries_per_second=0.0, max_tokens=1.0), clock=clock)
    r = retrier(clock, budgets=budgets)
    two = EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0, cap_s=0), idempotent=True, deadline_s=30)
    transport = Transport(bad_gateway())
    r.run(spec(two), transport)  # its one retry takes the only token
    with pytest.raises(RetryBudgetExhausted, match="repeats a failed call"):
        r.run(spec(EndpointPolicy(retry=QUICK, idempotent=True, deadline_s=30)), transport)
    assert transport.sends == 2


def test_an_unresolved_release_is_not_re_sent_without_a_probe() -> None:
    """After a read timeout (ambiguous) the repeat is refused as ambiguous; after a 502 the preset's trade-off re-sends."""
    clock = FakeClock()
    r, transport = retrier(clock), Transport(lost())
    with pytest.raises(AmbiguousOutcome):
        r.run(spec(RELEASE), transport)
    with pytest.raises(AmbiguousOutcome, match="earlier call's attempt may have been applied") as refused:
        r.run(spec(RELEASE), transport)
    assert transport.sends == 1
    assert [a.delivery for a in attempts_of(refused.value) or ()] == [Delivery.AMBIGUOUS]  # never proof of "not released"
    strict = EndpointPolicy(retry=QUICK, idempotent=False, deadline_s=30)
    gateway = Transport(bad_gateway())
    r.run(spec(strict, "/s"), gateway)  # handed back, not re-sent: the strict choice
    with pytest.raises(AmbiguousOutcome, match="status_502"):
        r.run(spec(strict, "/s"), gateway)
    assert gateway.sends == 1


@pytest.mark.parametrize(("answer", "sends"), [(ProbeAnswer.DONE, 1), (ProbeAnswer.NOT_DONE, 2)])
def test_the_probe_settles_a_repeat(answer: ProbeAnswer, sends: int) -> None:
    """A repeat of an unresolved release asks the probe: "done" answers "applied" without sending, "not done" sends."""
    clock = FakeClock()
    asked: list[ProbeContext] = []

    def probe(context: ProbeContext) -> ProbeAnswer:
        asked.append(context)
        return ProbeAnswer.UNKNOWN if len(asked) == 1 else answer

    policy = EndpointPolicy(retry=QUICK, idempotent=False, deadline_s=30, on_ambiguous=probe)
    r = retrier(clock)
    with pytest.raises(AmbiguousOutcome):
        r.run(spec(policy), Transport(lost()), on_probe_done=lambda: "applied")
    transport = Transport(AttemptResult(response="200", status=200))
    response, _records = r.run(spec(policy), transport, on_probe_done=lambda: "applied")
    assert response == ("applied" if answer is ProbeAnswer.DONE else "200")
    assert transport.sends == sends - 1 and len(asked) == 2


def test_window_must_be_positive() -> None:
    """A window that is not a positive number of seconds is refused, naming it."""
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ConfigError, match="window_s"):
            AttemptLedger(bad)  # type: ignore[arg-type]
