"""``resilience.retry.retrier``: ``Retrier.run`` and ``Retrier.arun`` drive one ``RetryCall`` alike; cancellation, probes, error classes.

No sockets: scripted transports and a fake clock. The parity property is the
claim that matters: for any script of what the transport saw, under any of
the policies drawn, the async driver makes exactly the decisions the sync
driver makes (responses, errors, attempts, sleeps and events).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from collections.abc import MutableMapping
from dataclasses import asdict, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilience import EndpointPolicy, RetryPolicy
from resilience.breaker import BreakerConfig, BreakerRegistry, BreakerState
from resilience.budget import RetryBudgetConfig, RetryBudgets
from resilience.errors import ConfigError, DeadlineExceeded, ErrorTypes, RetryBudgetExhausted
from resilience.events import CallEnded, Event
from resilience.outcome import CallOutcome, Delivery
from resilience.policy import ProbeAnswer
from resilience.retry.retrier import Retrier
from resilience.retry.spec import AttemptResult, CallSpec, Timeouts
from resilience.testing.clock import FakeClock
from tests.core.retry.scripts import ENGINE, lost, refused, spec, status

RESULTS = {
    "200": lambda: status(200),
    "502": lambda: status(502),
    "503ra": lambda: status(503, retry_after=0.2),
    "429ra": lambda: status(429, retry_after=50.0),
    "500": lambda: status(500),
    "404": lambda: status(404),
    "refused": refused,
    "lost": lost,
    "reset": lambda: AttemptResult(error=ConnectionResetError("reset"), delivery=Delivery.AMBIGUOUS, error_kind="connection_reset"),
}


def _policy(draw: st.DrawFn) -> tuple[EndpointPolicy, bool, str]:
    answers = [draw(st.sampled_from(["done", "not_done", "unknown", "boom"])) for _ in range(12)]

    def probe(ctx: Any) -> str:
        answer = answers[ctx.attempt % len(answers)]
        if answer == "boom":
            raise RuntimeError("probe failed")
        return answer

    policy = EndpointPolicy(
        retry=RetryPolicy(
            max_attempts=draw(st.integers(1, 5)),
            base_s=draw(st.sampled_from([0.0, 0.1, 1.0])),
            cap_s=2.0,
            retry_after_max_s=draw(st.sampled_from([0.5, 60.0])),
        ),
        idempotent=draw(st.booleans()),
        deadline_s=draw(st.sampled_from([None, 1.0, 3.0, 30.0])),
        attempt_timeout_s=draw(st.sampled_from([None, 1.0])),
        raise_on_exhausted=draw(st.booleans()),
        on_ambiguous=draw(st.sampled_from(["raise", probe, probe])),
    )
    return policy, draw(st.booleans()), draw(st.sampled_from(["POST", "GET"]))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[EndpointPolicy, bool, str, list[str], bool]:
    policy, explicit, method = _policy(draw)
    kinds = sorted(RESULTS)
    script = draw(st.lists(st.sampled_from([*kinds, "lost", "lost", "502", "502"]), min_size=1, max_size=8))
    return policy, explicit, method, script, draw(st.booleans())


class Transport:
    """Plays a script (then 200s) and records what it was asked."""

    def __init__(self, script: list[str], clock: FakeClock) -> None:
        self.script = list(script)
        self.clock = clock
        self.asked: list[tuple[int, Timeouts]] = []
        self.discarded: list[str] = []

    def attempt(self, n: int, timeouts: Timeouts, carrier: MutableMapping[str, str]) -> AttemptResult[str]:
        self.asked.append((n, timeouts))
        self.clock.advance(0.05)
        name = self.script.pop(0) if self.script else "200"
        return RESULTS[name]()

    async def aattempt(self, n: int, timeouts: Timeouts, carrier: MutableMapping[str, str]) -> AttemptResult[str]:
        await asyncio.sleep(0)
        return self.attempt(n, timeouts, carrier)

    def discard(self, response: str) -> None:
        self.discarded.append(response)

    def seen(self) -> tuple[list[tuple[int, Timeouts]], list[float], list[str]]:
        """What it was asked, the sleeps on its clock, and what it was told to release."""
        return self.asked, self.clock.sleeps, self.discarded

    async def adiscard(self, response: str) -> None:
        self.discard(response)


def _retrier(clock: FakeClock, events: list[Event]) -> Retrier:
    return Retrier(
        clock=clock,
        observers=[events.append],
        rng=lambda: 0.5,
        breakers=BreakerRegistry(BreakerConfig(minimum_calls=2, window_size=4), clock=clock),
        budgets=RetryBudgets(RetryBudgetConfig(max_tokens=3, min_retries_per_second=0), clock=clock),
    )


def _outcome(run: Any) -> dict[str, Any]:
    try:
        response, attempts = run()
        return {"response": response, "attempts": attempts}
    except Exception as exc:  # the comparison covers which error, its text and its attempts
        return {"error": type(exc), "text": str(exc), "attempts": getattr(exc, "attempts", None)}


def _drive(way: str, retrier: Retrier, transport: Transport, call_spec: CallSpec, confirm: bool) -> dict[str, Any]:
    probe_done = (lambda: "confirmed") if confirm else None
    if way == "sync":
        return _outcome(lambda: retrier.run(call_spec, transport.attempt, discard=transport.discard, on_probe_done=probe_done))
    return _outcome(lambda: asyncio.run(retrier.arun(call_spec, transport.aattempt, discard=transport.adiscard, on_probe_done=probe_done)))


def _events(events: list[Event]) -> list[dict[str, Any]]:
    return [{k: v for k, v in asdict(e).items() if k not in ("call_id", "carrier")} | {"kind": type(e).__name__} for e in events]  # type: ignore[call-overload]


Scenario = tuple[EndpointPolicy, bool, str, list[str], bool]


def _compare(scenario: Scenario) -> str:
    """Run one scenario through both drivers, assert they decided alike, and name how the call ended."""
    policy, explicit, method, script, confirm = scenario
    seen: dict[str, Any] = {}
    for way in ("sync", "async"):
        clock = FakeClock()
        events: list[Event] = []
        transport = Transport(script, clock)
        seen[way] = (
            _drive(way, _retrier(clock, events), transport, spec(policy, method, explicit=explicit), confirm),
            *transport.seen(),
            _events(events),
        )
    assert seen["sync"][1], "the transport was never asked: nothing compared"
    assert seen["sync"][4] and seen["sync"][4][0]["kind"] == "CallStarted" and seen["sync"][4][-1]["kind"] == "CallEnded"
    assert seen["async"] == seen["sync"]
    result = seen["sync"][0]
    return str(result["response"] if "response" in result else result["error"].__name__)


def _done_probe(ctx: Any) -> str:
    return "done"


_FAST = RetryPolicy(max_attempts=5, base_s=0, cap_s=0)


_SLOW = RetryPolicy(base_s=1, cap_s=1, jitter=0)


SEEDS: list[tuple[str, Scenario]] = [
    ("confirmed", (EndpointPolicy(idempotent=False, on_ambiguous=_done_probe), True, "POST", ["lost"], True)),
    ("RetryBudgetExhausted", (EndpointPolicy(retry=_FAST, deadline_s=30), True, "GET", ["502"] * 5, False)),
    (
        "ConnectionRefusedError",
        (
            EndpointPolicy(retry=RetryPolicy(base_s=1, cap_s=1, jitter=0), deadline_s=1.0, attempt_timeout_s=1),
            True,
            "GET",
            ["refused"] * 4,
            False,
        ),
    ),
    ("RetriesExhausted", (EndpointPolicy(retry=replace(_FAST, max_attempts=2), raise_on_exhausted=True), True, "GET", ["502"] * 2, False)),
    (
        "DeadlineExceeded",
        (EndpointPolicy(retry=_SLOW, deadline_s=1.0, attempt_timeout_s=1), True, "GET", ["502"] * 4, False),
    ),
    ("TimeoutError", (EndpointPolicy(retry=replace(_FAST, max_attempts=2)), True, "GET", ["lost"] * 2, False)),
    ("AmbiguousOutcome", (EndpointPolicy(idempotent=False), True, "POST", ["lost"], False)),
    ("resp200", (EndpointPolicy(retry=_FAST), True, "GET", ["502", "200"], False)),
    ("resp502", (EndpointPolicy(retry=replace(_FAST, max_attempts=2)), True, "GET", ["502"] * 2, False)),
    ("resp500", (EndpointPolicy(retry=_FAST), True, "GET", ["500"], False)),
    ("resp404", (EndpointPolicy(retry=_FAST), True, "GET", ["404"], False)),
]
"""Every ending the loop has, each reached for sure (hypothesis may not draw a rare one); the drawn scenarios add the breadth."""


def test_arun_decides_exactly_as_run() -> None:
    """For the seeds and every drawn script and policy: the same response or error, attempts, timeouts, sleeps, releases, events.

    Afterwards the calls must have ended in every way the loop can end, so
    the comparison covered them all.
    """
    endings: Counter[str] = Counter()
    for expected_ending, seed in SEEDS:
        assert _compare(seed) == expected_ending
        endings[expected_ending] += 1

    @settings(max_examples=int(os.environ.get("CPR_PARITY_EXAMPLES", "300")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(scenarios())
    def check(scenario: Scenario) -> None:
        endings[_compare(scenario)] += 1

    check()
    expected = {
        "resp200", "resp502", "resp500", "resp404", "confirmed",
        "AmbiguousOutcome", "DeadlineExceeded", "RetryBudgetExhausted", "RetriesExhausted", "TimeoutError", "ConnectionRefusedError",
    }  # fmt: skip
    assert expected <= set(endings), f"endings never drawn: {sorted(expected - set(endings))} (drawn: {dict(endings)})"
    assert sum(endings.values()) > 50, dict(endings)


GATEWAY_POLICY = EndpointPolicy(retry=RetryPolicy(max_attempts=5, base_s=10, cap_s=10, jitter=0), deadline_s=120)


@pytest.mark.asyncio
async def test_cancelled_during_backoff_sleep_sends_nothing_more_and_returns_the_slot() -> None:
    """The half-open probe call is cancelled in its 10 s backoff: one attempt only, the slot is free again."""
    registry = BreakerRegistry(BreakerConfig(minimum_calls=1, window_size=1, open_seconds=0, half_open_max_calls=1))
    breaker = registry.by_engine[ENGINE]
    breaker.record_failure()
    assert breaker.state is BreakerState.HALF_OPEN
    events: list[Event] = []
    retrier = Retrier(breakers=registry, observers=[events.append])
    sent: list[int] = []

    async def gateway(n: int, t: Timeouts, c: MutableMapping[str, str]) -> AttemptResult[str]:
        sent.append(n)
        return status(502)

    task = asyncio.create_task(retrier.arun(spec(GATEWAY_POLICY, "GET"), gateway))
    while not any(type(e).__name__ == "RetryScheduled" for e in events):
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    assert sent == [0]
    assert breaker.state is BreakerState.HALF_OPEN and breaker.admit() is not None  # the one probe slot came back
    ended = [e for e in events if isinstance(e, CallEnded)]
    assert len(ended) == 1 and ended[0].outcome is CallOutcome.FAILED and ended[0].error_type == "CancelledError"


@pytest.mark.asyncio
async def test_cancelled_during_an_attempt_records_it_as_ambiguous() -> None:
    """Cancelled while the attempt is in flight: recorded as ambiguous, the call ends, the slot comes back."""
    registry = BreakerRegistry(BreakerConfig(minimum_calls=1, window_size=1, open_seconds=0, half_open_max_calls=1))
    breaker = registry.by_engine[ENGINE]
    breaker.record_failure()
    events: list[Event] = []
    retrier = Retrier(breakers=registry, observers=[events.append])
    started = asyncio.Event()

    async def hang(n: int, t: Timeouts, c: MutableMapping[str, str]) -> AttemptResult[str]:
        started.set()
        await asyncio.sleep(60)
        return status(200)

    task = asyncio.create_task(retrier.arun(spec(GATEWAY_POLICY, "GET"), hang))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert breaker.admit() is not None
    ended = [e for e in events if isinstance(e, CallEnded)]
    assert len(ended) == 1 and ended[0].attempts == 1 and ended[0].error_type == "CancelledError"


@pytest.mark.asyncio
async def test_async_probe_is_awaited_and_sync_probe_runs_off_the_loop() -> None:
    """A coroutine probe is awaited; a blocking sync probe runs in a worker thread, not on the loop's thread."""
    loop_thread = threading.get_ident()
    threads: list[int] = []

    def blocking_probe(ctx: Any) -> ProbeAnswer:
        threads.append(threading.get_ident())
        return ProbeAnswer.DONE

    async def async_probe(ctx: Any) -> ProbeAnswer:
        await asyncio.sleep(0)
        return ProbeAnswer.DONE

    async def attempt(n: int, t: Timeouts, c: MutableMapping[str, str]) -> AttemptResult[str]:
        return lost()

    for probe in (blocking_probe, async_probe):
        policy = EndpointPolicy(idempotent=False, on_ambiguous=probe)
        response, attempts = await Retrier(clock=FakeClock()).arun(spec(policy), attempt, on_probe_done=lambda: "confirmed")
        assert response == "confirmed" and len(attempts) == 1
    assert threads and loop_thread not in threads


class FancyDeadline(DeadlineExceeded):
    """A driver's own deadline error (say, also an httpx.TimeoutException)."""


def test_error_types_are_the_drivers_subclasses() -> None:
    """The loop raises the driver's class; a class that does not subclass the default is refused at construction."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=5, base_s=1, cap_s=1, jitter=0), deadline_s=1.5, attempt_timeout_s=1)
    retrier = Retrier(clock=FakeClock(), error_types=ErrorTypes(deadline_exceeded=FancyDeadline))
    with pytest.raises(FancyDeadline) as info:
        retrier.run(spec(policy, "GET"), lambda n, t, c: status(502))
    assert info.value.endpoint == "GET /x" and len(info.value.attempts) >= 1
    with pytest.raises(ConfigError, match=r"ErrorTypes.circuit_open must be a subclass of CircuitOpen"):
        ErrorTypes(circuit_open=FancyDeadline)  # type: ignore[arg-type]


def test_one_retrier_serves_threads_and_tasks_at_once() -> None:
    """4 threads and 4 event loops of 50 tasks share one breaker and one budget: every call ends, counts add up.

    The budget starts with 5 tokens, no refill, 0 deposit: exactly 5 retries may
    happen in all, whoever asks; every call is 502 then 200 (a retry), so 5
    calls succeed after a retry and the rest end with budget exhaustion.
    """
    budgets = RetryBudgets(RetryBudgetConfig(ratio=0, min_retries_per_second=0, max_tokens=5))
    registry = BreakerRegistry(BreakerConfig(failure_threshold=0, window_size=1000, minimum_calls=1000))
    retrier = Retrier(breakers=registry, budgets=budgets)
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0, cap_s=0), deadline_s=30)
    outcomes: list[str] = []
    lock = threading.Lock()

    def script() -> Any:
        seen: list[int] = []

        def attempt(n: int, t: Timeouts, c: MutableMapping[str, str]) -> AttemptResult[str]:
            seen.append(n)
            return status(200 if n else 502)

        return attempt

    def note(kind: str) -> None:
        with lock:
            outcomes.append(kind)

    def sync_worker() -> None:
        for _ in range(50):
            try:
                retrier.run(spec(policy, "GET"), script())
                note("ok")
            except RetryBudgetExhausted:
                note("budget")

    async def one() -> None:
        sync_attempt = script()

        async def attempt(n: int, t: Timeouts, c: MutableMapping[str, str]) -> AttemptResult[str]:
            await asyncio.sleep(0)
            return sync_attempt(n, t, c)

        try:
            await retrier.arun(spec(policy, "GET"), attempt)
            note("ok")
        except RetryBudgetExhausted:
            note("budget")

    async def async_worker() -> None:
        await asyncio.gather(*(one() for _ in range(50)))

    threads = [threading.Thread(target=sync_worker) for _ in range(4)]
    threads += [threading.Thread(target=lambda: asyncio.run(async_worker())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(outcomes) == 400
    assert outcomes.count("ok") == 5 and outcomes.count("budget") == 395
    assert registry.by_engine[ENGINE].state is BreakerState.CLOSED
