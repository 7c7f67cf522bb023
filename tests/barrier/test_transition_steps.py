"""The transitions as steps, driven by hand with no orchestrator and no fan-out: what each one yields, in order, and
what the fold makes of each answer (``resilience.barrier.transitions``, ``resilience.barrier.state``).

Each test builds a ``BarrierState`` over engines that are never called (the answers are written here), then sends the
steps of ``offload_steps`` / ``onload_steps`` / ``pause_steps`` back filled in, as a driver would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import pytest

from resilience.barrier.fanout import EngineResult, PhaseTimeout
from resilience.barrier.state import BarrierOptions, BarrierState, Effect, EngineGroup, PhaseDeadlines, PhaseFailed, effect_of
from resilience.barrier.transitions import (
    PhaseStep,
    ReadStep,
    SettleStep,
    Step,
    Steps,
    WaitStep,
    abandon,
    offload_steps,
    onload_steps,
    pause_steps,
    resume,
    unpause_steps,
)
from resilience.engine_contract import EngineState
from resilience.outcome import AttemptRecord, Delivery, Outcome
from tests.barrier.fake_engine import ALL, FakeEngine

T = TypeVar("T")
A, B = "http://a:30000", "http://b:30000"
DEADLINES = PhaseDeadlines(transition_s=30.0, pause_s=5, flush_s=5, release_s=5, resume_s=5, continue_s=5)

Answer = Callable[[str, str, Mapping[str, Any]], BaseException | None]
"""(engine, method, kwargs) -> the error its call ended with, or None when it returned."""


def barrier_state(*names: str) -> BarrierState[Any]:
    state: BarrierState[Any] = BarrierState(EngineGroup([FakeEngine(n) for n in names]), BarrierOptions(deadlines=DEADLINES))
    resume(state)  # no journal: nothing to resume, as an orchestrator's constructor does
    return state


def ok(_engine: str, _method: str, _kwargs: Mapping[str, Any]) -> BaseException | None:
    return None


Phases = list[tuple[str, tuple[str, ...]]]
"""The phases a transition yielded, in order: (method, the engines it went to)."""


def drive(steps: Steps[T], answer: Answer = ok, phases: Phases | None = None) -> tuple[Phases, T]:
    """Send every step back answered: each phase's calls by ``answer``; no late call lands, waits pass at once.

    Returns the phases in the order they were yielded (also appended to ``phases``, which keeps them when the
    transition raises), and the transition's result.
    """
    phases = [] if phases is None else phases
    try:
        step: Step = next(steps)
    except StopIteration as stop:  # nothing to send at all
        return phases, stop.value
    while True:
        if isinstance(step, PhaseStep):
            names = tuple(name for name, _ in step.calls)
            phases.append((step.method, names))
            step.results = [EngineResult(name, error=answer(name, step.method, kwargs)) for name, kwargs in step.calls]
        elif isinstance(step, ReadStep):
            step.error = RuntimeError("no reads in this test")
        else:
            assert isinstance(step, SettleStep | WaitStep), step
        try:
            step = steps.send(None)
        except StopIteration as stop:
            return phases, stop.value


def reset_after_sending(method: str) -> BaseException:
    """What a driver raises when the connection reset after the request left: its record says it may have applied."""
    error = ConnectionResetError(f"{method}: connection reset by peer")
    error.attempts = (AttemptRecord(1, None, Outcome.AMBIGUOUS, Delivery.AMBIGUOUS, "ConnectionResetError", 0.01),)  # type: ignore[attr-defined]
    return error


def test_offload_is_pause_then_flush_then_release_for_every_engine() -> None:
    state = barrier_state(A, B)
    phases, report = drive(offload_steps(state, ALL, "abort"))
    assert phases == [
        ("pause_generation", (A, B)),
        ("flush_cache", (A, B)),
        ("release_memory_occupation", (A, B)),
    ]
    assert [p.phase for p in report.phases] == ["pause", "flush", "release"]
    assert state.states() == {A: EngineState.RELEASED, B: EngineState.RELEASED}
    assert all(state.know[n].released == set(ALL) and state.know[n].paused is True for n in (A, B))


def test_a_second_offload_sends_nothing_and_onload_resumes_then_continues() -> None:
    state = barrier_state(A, B)
    drive(offload_steps(state, ALL, "abort"))
    again, _ = drive(offload_steps(state, ALL, "abort"))
    assert again == [], "every tag is known released and every engine known paused: an idempotent offload sends nothing"
    phases, report = drive(onload_steps(state, ALL))
    assert phases == [("resume_memory_occupation", (A, B)), ("continue_generation", (A, B))]
    assert report.held == {}
    assert state.states() == {A: EngineState.SERVING, B: EngineState.SERVING}


def test_an_ambiguous_release_is_folded_as_unknown_and_never_resumed_or_continued() -> None:
    """B's release may have been applied: the fold leaves B's tags unknown (quarantined); the rollback resumes and
    continues A only, and the transition names B."""
    state = barrier_state(A, B)

    def answer(engine: str, method: str, _kwargs: Mapping[str, Any]) -> BaseException | None:
        return reset_after_sending(method) if (engine, method) == (B, "release_memory_occupation") else None

    with pytest.raises(PhaseFailed) as failed:
        drive(offload_steps(state, ALL, "abort"), answer)
    assert failed.value.phase == "release" and B in failed.value.failures and B in failed.value.quarantined
    assert effect_of(reset_after_sending("release_memory_occupation")) is Effect.AMBIGUOUS
    k = state.know[B]
    assert k.unknown == set(ALL) and k.released == set() and k.quarantined
    assert state.states()[B] is EngineState.QUARANTINED
    assert state.quarantined() == {B: ALL}
    assert state.states()[A] is EngineState.SERVING, "the rollback resumed A's memory and continued it"
    # the next onload sends nothing to B (a resume of a tag it may not have released kills SGLang) and names it
    phases: Phases = []
    with pytest.raises(PhaseFailed, match="skipped"):
        drive(onload_steps(state, ALL), ok, phases)
    assert all(B not in engines for _, engines in phases), phases


def test_a_call_that_never_left_is_folded_as_not_applied() -> None:
    """A pause the fan-out never started (``PhaseTimeout(maybe_sent=False)``) changes nothing: the engine is known
    serving, not unknown, and the offload stops before any flush or release."""
    state = barrier_state(A)
    never_sent = PhaseTimeout("no time left for pause_generation", maybe_sent=False)
    assert effect_of(never_sent) is Effect.NOT_APPLIED

    def answer(_engine: str, method: str, _kwargs: Mapping[str, Any]) -> BaseException | None:
        return never_sent if method == "pause_generation" else None

    phases: Phases = []
    with pytest.raises(PhaseFailed) as failed:
        drive(offload_steps(state, ALL, "abort"), answer, phases)
    assert failed.value.phase == "pause" and A in failed.value.failures
    assert [method for method, _ in phases] == ["pause_generation"], "nothing after a pause that did not happen"
    k = state.know[A]
    assert k.paused is False and not k.unknown and state.states()[A] is EngineState.SERVING


def test_a_pause_takes_a_hold_and_its_end_continues_only_once_no_hold_is_left() -> None:
    state = barrier_state(A)
    phases, first = drive(pause_steps(state, "eval", "abort"))
    assert phases == [("pause_generation", (A,))]
    _, second = drive(pause_steps(state, "eval", "abort"))
    assert first.hold is not None and second.hold is not None and first.hold.id != second.hold.id
    assert state.held() == {A: ("eval",)}
    phases, _ = drive(unpause_steps(state, first.hold))
    assert phases == [], "another hold keeps the engine paused: no continue"
    phases, _ = drive(unpause_steps(state, second.hold))
    assert phases == [("continue_generation", (A,))]
    assert state.states() == {A: EngineState.SERVING}


def test_a_phase_is_written_ahead_and_a_driver_that_stops_leaves_it_ambiguous() -> None:
    """When the release step is yielded its tags are already unknown (written ahead); a driver that stops there
    (``abandon``) with no answer leaves them so: quarantined, never forgotten."""
    state = barrier_state(A)
    steps = offload_steps(state, ALL, "abort")
    step = next(steps)
    while not (isinstance(step, PhaseStep) and step.method == "release_memory_occupation"):
        assert isinstance(step, PhaseStep), step
        step.results = [EngineResult(name) for name, _ in step.calls]
        step = steps.send(None)
    assert state.know[A].unknown == set(ALL) and state.know[A].released == set(), "marked before it is sent"
    abandon(state, steps, step, KeyboardInterrupt())
    assert state.quarantined() == {A: ALL} and state.states()[A] is EngineState.QUARANTINED
