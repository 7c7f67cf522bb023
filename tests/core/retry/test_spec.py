"""``resilience.retry.spec``: the pure rules of one call, driven directly: ``attempt_timeouts``, ``deadline_times``, ``classify``.

Each rule as a table of cases, then the properties that hold for every policy, caller timeout and cap drawn.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from resilience import Deadline, EndpointPolicy, PolicyTable, RetryPolicy
from resilience.outcome import Delivery, Outcome
from resilience.retry.spec import CallSpec, Timeouts, attempt_timeouts, classify, deadline_times
from resilience.testing.clock import FakeClock

ENGINE = "http://127.0.0.1:1"


def spec(policy: EndpointPolicy | None, caller: Timeouts | None, method: str = "POST") -> CallSpec:
    """A call to ``/x``: matched by an entry holding ``policy``, or by no entry (the default policy) when None."""
    table = PolicyTable() if policy is None else PolicyTable({f"{method} /x": policy})
    return CallSpec(method, f"{ENGINE}/x", table.match(method, "/x"), ENGINE, "127.0.0.1", 1, request_timeout=caller)


# -- attempt_timeouts ----------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "caller", "expected"),
    [
        # an entry that never named a timeout yields to the caller, shorter or longer
        (EndpointPolicy(idempotent=False), (0.5, 0.5), (0.5, 0.5)),
        (EndpointPolicy(idempotent=False), (60.0, 60.0), (60.0, 60.0)),
        (EndpointPolicy(idempotent=False), (None, None), (None, None)),
        # ... and applies its default only when the caller said nothing
        (EndpointPolicy(idempotent=False), None, (10.0, 10.0)),
        # a named timeout wins over the caller's, both ways
        (EndpointPolicy(attempt_timeout_s=2), (0.5, 0.5), (2, 2)),
        (EndpointPolicy(attempt_timeout_s=2), (60.0, 60.0), (2, 2)),
        (EndpointPolicy(attempt_timeout_s=10.0), (60.0, 60.0), (10.0, 10.0)),
        # a named None (no per-attempt limit) leaves the caller's
        (EndpointPolicy(attempt_timeout_s=None), (3.0, 4.0), (3.0, 4.0)),
        (EndpointPolicy(attempt_timeout_s=None), None, (None, None)),
        # the default policy (no entry matched) yields to the caller
        (None, (0.5, 7.0), (0.5, 7.0)),
        (None, None, (10.0, 10.0)),
    ],
)
def test_attempt_timeouts_precedence(policy: EndpointPolicy | None, caller: Timeouts | None, expected: Timeouts) -> None:
    """A named entry timeout beats the caller's; an unnamed one and the default's apply only when the caller gave none."""
    assert attempt_timeouts(spec(policy, caller)) == expected


def test_attempt_timeouts_capped_by_what_is_left() -> None:
    """Every limit is capped by ``cap_s``; no limit under a cap is the cap; no cap and no limit stays None."""
    assert attempt_timeouts(spec(EndpointPolicy(attempt_timeout_s=5), None), 1.5) == (1.5, 1.5)
    assert attempt_timeouts(spec(EndpointPolicy(), (None, 8.0)), 2.0) == (2.0, 2.0)
    assert attempt_timeouts(spec(EndpointPolicy(), (0.2, 8.0)), 2.0) == (0.2, 2.0)
    assert attempt_timeouts(spec(EndpointPolicy(attempt_timeout_s=None), (None, None))) == (None, None)


def test_attempt_timeouts_hand_out_plain_floats() -> None:
    """The unnamed default reaches the transport as a plain ``float``, not the marker type."""
    connect, read = attempt_timeouts(spec(EndpointPolicy(), None))
    assert type(connect) is float and type(read) is float


# -- deadline_times ----------------------------------------------------------


def call_deadlines(call: CallSpec, clock: FakeClock) -> tuple[float, float, bool]:
    """(hard, window) seconds left at the clock's now (``inf``: unbounded), and whether they are one deadline."""
    now = clock.monotonic()
    window_at, hard_at = deadline_times(call, now)
    return (window_at if hard_at is None else hard_at) - now, window_at - now, hard_at is None


def remaining(seconds: float) -> float | None:
    return None if seconds == math.inf else seconds


@pytest.mark.parametrize(
    ("policy", "caller", "hard", "window"),
    [
        # an unnamed deadline under the caller's timeout is only a retry window
        (EndpointPolicy(idempotent=False), (60.0, 60.0), None, 30.0),
        (None, (2.0, 2.0), None, 30.0),
        # ... and hard when the caller gave none
        (EndpointPolicy(idempotent=False), None, 30.0, 30.0),
        (None, None, 30.0, 30.0),
        # a named deadline is hard
        (EndpointPolicy(deadline_s=12), (60.0, 60.0), 12.0, 12.0),
        (EndpointPolicy(deadline_s=30.0), (60.0, 60.0), 30.0, 30.0),
        # no deadline at all: the caller's timeouts, summed
        (EndpointPolicy(deadline_s=None, attempt_timeout_s=None), (1.0, 2.0), 3.0, 3.0),
        (EndpointPolicy(deadline_s=None, attempt_timeout_s=None), (None, None), None, None),
    ],
)
def test_call_deadlines(policy: EndpointPolicy | None, caller: Timeouts | None, hard: float | None, window: float | None) -> None:
    """Which deadline caps attempts (hard) and which only stops new retries (window), on a clock that does not move."""
    got_hard, got_window, _ = call_deadlines(spec(policy, caller), FakeClock())
    assert (remaining(got_hard), remaining(got_window)) == (hard, window)


def test_an_outer_deadline_is_always_hard() -> None:
    """A caller's ``with Deadline(4):`` caps both, even over an unnamed deadline and the caller's timeout."""
    clock = FakeClock()
    with Deadline(4, clock=clock):
        hard, window, _ = call_deadlines(spec(EndpointPolicy(), (60.0, 60.0)), clock)
    assert (remaining(hard), remaining(window)) == (4.0, 4.0)


# -- classify ----------------------------------------------------------------

IDEMPOTENT = EndpointPolicy()
UNSAFE = EndpointPolicy(idempotent=False)
UNSAFE_GATEWAY = EndpointPolicy(idempotent=False, retry_statuses_if_not_idempotent=True)


@pytest.mark.parametrize(
    ("policy", "status", "delivery", "retry_after", "outcome"),
    [
        (IDEMPOTENT, 200, Delivery.RESPONDED, None, Outcome.SUCCESS),
        (IDEMPOTENT, 204, Delivery.RESPONDED, None, Outcome.SUCCESS),
        (EndpointPolicy(accept_statuses=frozenset({404})), 404, Delivery.RESPONDED, None, Outcome.SUCCESS),
        (IDEMPOTENT, 404, Delivery.RESPONDED, None, Outcome.FATAL),
        (IDEMPOTENT, 500, Delivery.RESPONDED, None, Outcome.FATAL),
        (IDEMPOTENT, 502, Delivery.RESPONDED, None, Outcome.RETRYABLE),
        (UNSAFE, 502, Delivery.RESPONDED, None, Outcome.FATAL),
        (UNSAFE_GATEWAY, 503, Delivery.RESPONDED, None, Outcome.RETRYABLE),
        (IDEMPOTENT, 429, Delivery.RESPONDED, None, Outcome.FATAL),
        (IDEMPOTENT, 429, Delivery.RESPONDED, 1.0, Outcome.RETRYABLE),
        (EndpointPolicy(retry=RetryPolicy(respect_retry_after=False)), 429, Delivery.RESPONDED, 1.0, Outcome.FATAL),
        (IDEMPOTENT, None, Delivery.NOT_SENT, None, Outcome.RETRYABLE),
        (UNSAFE, None, Delivery.NOT_SENT, None, Outcome.RETRYABLE),
        (EndpointPolicy(retry=RetryPolicy(retry_before_send=False)), None, Delivery.NOT_SENT, None, Outcome.FATAL),
        (IDEMPOTENT, None, Delivery.AMBIGUOUS, None, Outcome.AMBIGUOUS),
        (UNSAFE, None, Delivery.AMBIGUOUS, None, Outcome.AMBIGUOUS),
    ],
)
def test_classify_follows_its_rules(
    policy: EndpointPolicy, status: int | None, delivery: Delivery, retry_after: float | None, outcome: Outcome
) -> None:
    """Each rule of ``classify``'s docstring, one row each: success, gateway statuses, 429, never sent, ambiguous."""
    assert classify(policy, status=status, delivery=delivery, retry_after=retry_after) is outcome


# -- properties: what holds for every policy, caller timeout, cap and outer deadline drawn ----------

SECONDS = st.sampled_from([0.5, 1.0, 2.0, 10.0, 30.0, 60.0])
CAPS = st.sampled_from([math.inf, 0.0, 0.3, 1.0, 5.0, 100.0])


@st.composite
def time_policies(draw: st.DrawFn) -> EndpointPolicy | None:
    """A table entry naming any of its two time fields (or leaving them at their defaults), or None: no entry matched."""
    if draw(st.booleans()):
        return None
    kwargs: dict[str, object] = {"idempotent": draw(st.booleans())}
    if draw(st.booleans()):
        kwargs["attempt_timeout_s"] = draw(st.none() | SECONDS)
    if draw(st.booleans()):
        kwargs["deadline_s"] = draw(st.none() | SECONDS)
    try:
        return EndpointPolicy(**kwargs)  # type: ignore[arg-type]
    except ValueError:  # a named attempt timeout over the deadline: not a policy anyone can build
        assume(False)
        raise


CALLER_TIMEOUTS = st.none() | st.tuples(st.none() | SECONDS, st.none() | SECONDS)


def _bound(value: float | None) -> float:
    return math.inf if value is None else value


@given(policy=time_policies(), caller=CALLER_TIMEOUTS, cap=CAPS)
def test_attempt_timeouts_precedence_then_the_cap(policy: EndpointPolicy | None, caller: Timeouts | None, cap: float) -> None:
    """Precedence picks the limit (a named entry timeout, else the caller's, else the policy's); the cap applies last, to each part."""
    call = spec(policy, caller)
    uncapped = attempt_timeouts(call)
    if policy is not None and policy.named("attempt_timeout_s") and policy.attempt_timeout_s is not None:
        assert uncapped == (policy.attempt_timeout_s, policy.attempt_timeout_s)
    elif caller is not None:
        assert uncapped == caller
    capped = attempt_timeouts(call, cap)
    for before, after in zip(uncapped, capped, strict=True):
        expected = min(_bound(before), cap)
        assert _bound(after) == expected and (after is None) == (expected == math.inf)


@given(policy=time_policies(), caller=CALLER_TIMEOUTS, outer=st.none() | SECONDS)
def test_call_deadlines_never_let_a_retry_start_after_attempts_must_stop(
    policy: EndpointPolicy | None, caller: Timeouts | None, outer: float | None
) -> None:
    """The retry window ends no later than the hard deadline; an outer deadline caps both; hard and window are one unless the
    caller's own timeout governs an unnamed ``deadline_s``; a set ``deadline_s`` bounds the window."""
    clock = FakeClock()
    call = spec(policy, caller)
    if outer is None:
        hard, window, one = call_deadlines(call, clock)
    else:
        with Deadline(outer, clock=clock):
            hard, window, one = call_deadlines(call, clock)
    assert window <= hard
    if outer is not None:
        assert hard <= outer and window <= outer
    named = policy is not None and policy.named("deadline_s")
    assert one == (caller is None or named)
    if not one:
        assert hard == (math.inf if outer is None else outer)
    deadline_s = call.match.policy.deadline_s
    if deadline_s is not None:
        assert window <= deadline_s


STATUSES = st.sampled_from([200, 204, 299, 404, 409, 429, 500, 502, 503, 504]) | st.integers(100, 599)


@st.composite
def class_policies(draw: st.DrawFn) -> EndpointPolicy:
    """The fields ``classify`` reads, each drawn."""
    return EndpointPolicy(
        retry=RetryPolicy(
            statuses=draw(st.frozensets(st.sampled_from([500, 502, 503, 504, 429]), min_size=1)),
            respect_retry_after=draw(st.booleans()),
            retry_before_send=draw(st.booleans()),
        ),
        idempotent=draw(st.booleans()),
        retry_statuses_if_not_idempotent=draw(st.booleans()),
        accept_statuses=draw(st.frozensets(st.sampled_from([404, 409, 502]))),
    )


@given(policy=class_policies(), status=st.none() | STATUSES, delivery=st.sampled_from(list(Delivery)), retry_after=st.none() | SECONDS)
def test_classify_reads_a_status_before_anything_else(
    policy: EndpointPolicy, status: int | None, delivery: Delivery, retry_after: float | None
) -> None:
    """A status decides alone (never ambiguous, the delivery ignored; success exactly for 2xx and accepted ones; retryable only
    where the endpoint may re-send); without one, only the delivery and ``retry_before_send`` decide, idempotency never."""
    outcome = classify(policy, status=status, delivery=delivery, retry_after=retry_after)
    if status is not None:
        assert outcome is not Outcome.AMBIGUOUS
        assert all(classify(policy, status=status, delivery=d, retry_after=retry_after) is outcome for d in Delivery)
        assert (outcome is Outcome.SUCCESS) == (200 <= status < 300 or status in policy.accept_statuses)
        if outcome is Outcome.RETRYABLE:
            assert policy.idempotent or policy.retry_statuses_if_not_idempotent
    else:
        flipped = dataclasses.replace(policy, idempotent=not policy.idempotent)
        assert classify(flipped, status=None, delivery=delivery, retry_after=retry_after) is outcome
        if delivery is Delivery.NOT_SENT:
            assert outcome is (Outcome.RETRYABLE if policy.retry.retry_before_send else Outcome.FATAL)
        else:
            assert outcome is Outcome.AMBIGUOUS


# -- deadline_times ------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "caller", "outer", "expected"),
    [
        # the caller bounded the attempts and no entry named a deadline: the window only bounds retries
        (EndpointPolicy(), (60.0, 60.0), None, (130.0, math.inf)),
        (EndpointPolicy(), (60.0, 60.0), 4.0, (104.0, 104.0)),
        # the caller said nothing, or an entry named the deadline: one deadline for both (hard_at None)
        (EndpointPolicy(), None, None, (130.0, None)),
        (EndpointPolicy(deadline_s=12), (60.0, 60.0), None, (112.0, None)),
        (EndpointPolicy(deadline_s=12), (60.0, 60.0), 4.0, (104.0, None)),
        # no deadline anywhere: the caller's timeouts summed, or never
        (EndpointPolicy(deadline_s=None, attempt_timeout_s=None), (1.0, None), None, (101.0, None)),  # a named None
        (EndpointPolicy(deadline_s=None, attempt_timeout_s=None), (None, None), None, (math.inf, None)),
        (EndpointPolicy(attempt_timeout_s=None), (1.0, None), None, (130.0, math.inf)),
    ],
)
def test_deadline_times_as_readings(
    policy: EndpointPolicy, caller: Timeouts | None, outer: float | None, expected: tuple[float, float | None]
) -> None:
    """``(window_at, hard_at)`` at ``now`` = 100: ``hard_at`` None when the window is the hard deadline too."""
    clock = FakeClock(100.0)
    call = spec(policy, caller)
    if outer is None:
        times = deadline_times(call, 100.0)
    else:
        with Deadline(outer, clock=clock):
            times = deadline_times(call, 100.0)
    assert times == expected


def test_a_match_derives_its_timing_rules_once() -> None:
    """``EndpointMatch.own_timeout_s`` / ``own_deadline``: what an entry named, never the defaults nor the default policy's."""
    table = PolicyTable({"POST /named": EndpointPolicy(attempt_timeout_s=2, deadline_s=9), "POST /unnamed": EndpointPolicy()})
    named, unnamed, default = table.match("POST", "/named"), table.match("POST", "/unnamed"), table.match("POST", "/other")
    assert (named.own_timeout_s, named.own_deadline) == (2.0, True)
    assert (unnamed.own_timeout_s, unnamed.own_deadline) == (None, False)
    assert (default.own_timeout_s, default.own_deadline) == (None, False)
    assert type(named.own_timeout_s) is float
    assert named == dataclasses.replace(named)  # derived fields take no part in equality and are rebuilt by replace
