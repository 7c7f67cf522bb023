"""Each control call's precondition, one at a time, on socket-free engines with SGLang's crash semantics.

Every test that drives an orchestrator runs twice: ``ThreadFanOut`` over ``FakeEngine`` and ``AsyncFanOut`` over
``AsyncFakeEngine`` (same state, faults and crash rules, with coroutine calls).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from resilience.barrier import BarrierBusy, EngineGroup, EngineSkipped, Orchestrator, PhaseDeadlines, PhaseFailed
from resilience.barrier.async_fanout import AsyncFanOut
from resilience.barrier.fanout import FanOut, PhaseTimeout, ThreadFanOut
from resilience.barrier.state import Effect, EngineKnowledge, PhaseEnded, TransitionEnded, effect_of, is_engine_dead
from resilience.engine_contract import EngineDied, EngineState, EngineUnavailable
from resilience.errors import RetriesExhausted
from resilience.events import Event, Outcome
from resilience.outcome import AttemptRecord, Delivery
from resilience.testing.clock import FakeClock
from tests.barrier.fake_engine import ALL, AnyFake, AsyncFakeEngine, FakeEngine, Fault

DEADLINES = PhaseDeadlines(transition_s=5.0, pause_s=0.3, flush_s=0.3, release_s=0.3, resume_s=0.3, continue_s=0.3)
"""Phase limits a late call waits out (defect 7), long enough that no prompt call misses one on a loaded machine."""


@pytest.fixture(params=["threads", "async"])
def fanout(request: pytest.FixtureRequest) -> Iterator[ThreadFanOut | AsyncFanOut]:
    """Each test on both fan-outs; ``fakes`` builds the engines that fan-out drives."""
    pool = ThreadFanOut(max_workers=8) if request.param == "threads" else AsyncFanOut()
    yield pool
    pool.close()


def fakes(fanout: FanOut, n: int) -> list[AnyFake]:
    """``n`` fake engines of the kind ``fanout`` drives: synchronous for ThreadFanOut, async for AsyncFanOut."""
    kind = AsyncFakeEngine if isinstance(fanout, AsyncFanOut) else FakeEngine
    return [kind(f"http://fake-{i}:30000") for i in range(n)]


def make(fanout: FanOut, n: int = 2) -> tuple[list[AnyFake], Orchestrator[Any]]:
    engines = fakes(fanout, n)
    return engines, Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES)


def alive(engines: list[AnyFake]) -> None:
    for e in engines:
        assert e.crash is None and not e.violations, (e.engine, e.crash, e.violations)


def attempt(delivery: Delivery, status: int | None = None) -> AttemptRecord:
    return AttemptRecord(0, status, Outcome.AMBIGUOUS, delivery, "ReadTimeout", 0.1)


class _Response:
    """A response as the drivers hand it back: the record rides on it."""

    def __init__(self, *attempts: AttemptRecord) -> None:
        self.attempts = attempts


def with_record(error: BaseException, *attempts: AttemptRecord) -> BaseException:
    error.attempts = attempts  # type: ignore[attr-defined]
    return error


def test_effect_of_reads_only_the_driver_record() -> None:
    """No error: applied. The barrier's own "never started" and skips: not applied. A record with an attempt that may have
    been applied, or a gateway status, or no record at all: maybe. Every attempt not sent, or the engine's own error: not applied."""
    assert effect_of(None) is Effect.APPLIED
    assert effect_of(PhaseTimeout("queued", maybe_sent=False)) is Effect.NOT_APPLIED
    assert effect_of(EngineSkipped("skipped")) is Effect.NOT_APPLIED
    bare_status = ValueError("HTTP 500, no record")
    bare_status.status = 500  # type: ignore[attr-defined]
    for no_record in (PhaseTimeout("late"), EngineDied("actor died"), EngineUnavailable("unavailable"), ValueError("bug"), bare_status):
        assert effect_of(no_record) is Effect.AMBIGUOUS, no_record  # conservative: nobody said the request never left
    maybe = RetriesExhausted("x", attempts=(attempt(Delivery.AMBIGUOUS), attempt(Delivery.RESPONDED, 500)))
    assert effect_of(maybe) is Effect.AMBIGUOUS
    assert effect_of(RetriesExhausted("x", attempts=(attempt(Delivery.NOT_SENT), attempt(Delivery.RESPONDED, 500)))) is Effect.NOT_APPLIED
    for gateway in (502, 503, 504):  # a proxy may answer these after it forwarded: whatever the retry policy did with them
        after = RetriesExhausted("x", attempts=(attempt(Delivery.RESPONDED, gateway), attempt(Delivery.RESPONDED, 500)))
        assert effect_of(after) is Effect.AMBIGUOUS, gateway
    on_response = with_record(ValueError("x"))
    del on_response.attempts  # type: ignore[attr-defined]
    on_response.response = _Response(attempt(Delivery.RESPONDED, 504))  # type: ignore[attr-defined]
    assert effect_of(on_response) is Effect.AMBIGUOUS
    assert effect_of(with_record(ValueError("2xx, bad body"), attempt(Delivery.RESPONDED, 200))) is Effect.AMBIGUOUS
    assert effect_of(with_record(ValueError("engine said no"), attempt(Delivery.RESPONDED, 400))) is Effect.NOT_APPLIED
    # an empty record is no record (attempts_of gives None): nothing proves the request never left
    assert effect_of(RetriesExhausted("no attempt was made", attempts=())) is Effect.AMBIGUOUS


def test_effect_and_death_never_depend_on_the_library() -> None:
    """The same transport error reads as its record says: maybe without one, not applied (and dead) when every attempt was refused."""
    import aiohttp
    import httpx

    for error in (requests.ConnectTimeout("connect"), httpx.ConnectError("refused"), OSError(111, "refused"), TimeoutError()):
        assert effect_of(error) is Effect.AMBIGUOUS and not is_engine_dead(error), error
        refused = with_record(error, attempt(Delivery.NOT_SENT), attempt(Delivery.NOT_SENT))
        assert effect_of(refused) is Effect.NOT_APPLIED and is_engine_dead(refused), error
    reset = with_record(aiohttp.ServerDisconnectedError(), attempt(Delivery.NOT_SENT), attempt(Delivery.AMBIGUOUS))
    assert effect_of(reset) is Effect.AMBIGUOUS and not is_engine_dead(reset)
    assert is_engine_dead(EngineDied("gone")) and not is_engine_dead(RetriesExhausted("x", attempts=()))
    behind_proxy = with_record(ValueError("502"), attempt(Delivery.RESPONDED, 502))
    assert effect_of(behind_proxy) is Effect.AMBIGUOUS and not is_engine_dead(behind_proxy)


def test_a_breaker_refusal_is_not_applied_but_never_proves_the_engine_dead() -> None:
    """The drivers record an open breaker as one NOT_SENT entry named CircuitOpen: nothing was sent, but the breaker may have
    opened on 502s, so only the call's real refusals (if any) can say the engine is gone."""
    from resilience.errors import CircuitOpen

    breaker = AttemptRecord(0, None, Outcome.RETRYABLE, Delivery.NOT_SENT, "CircuitOpen", 0.0)
    only_breaker = CircuitOpen("circuit open", attempts=(breaker,))
    assert effect_of(only_breaker) is Effect.NOT_APPLIED and not is_engine_dead(only_breaker)
    refused_then_open = CircuitOpen("circuit open", attempts=(attempt(Delivery.NOT_SENT), breaker))
    assert effect_of(refused_then_open) is Effect.NOT_APPLIED and is_engine_dead(refused_then_open)


def test_knowledge_table() -> None:
    """An ambiguous release or resume makes its tags unknown (quarantine); an ambiguous continue makes "paused" unknown."""
    k = EngineKnowledge("e")
    k.apply("pause_generation", {"mode": "abort"}, Effect.APPLIED)
    k.apply("flush_cache", {}, Effect.APPLIED)
    assert k.may_release("kv_cache") and k.state is EngineState.FLUSHED
    k.apply("release_memory_occupation", {"tags": ["kv_cache"]}, Effect.AMBIGUOUS)
    assert k.quarantined and not k.may_release("weights") and not k.may_resume("kv_cache") and not k.may_continue()
    k.reconcile(released=["kv_cache"], paused=True)
    assert k.may_resume("kv_cache") and not k.may_release("kv_cache")
    k.apply("resume_memory_occupation", {"tags": None}, Effect.AMBIGUOUS)
    assert k.unknown == set(ALL) and k.released == set()
    k.reconcile(released=(), paused=True)
    k.apply("continue_generation", {}, Effect.AMBIGUOUS)
    assert k.paused is None and k.state is EngineState.UNKNOWN and k.may_continue()


def test_defect_1_ambiguous_release_quarantines(fanout: FanOut) -> None:
    """An applied-then-ambiguous release is never released again nor continued: offload and onload name the engine instead."""
    engines, orch = make(fanout)
    engines[0].arm("release_memory_occupation", Fault.AMBIGUOUS_APPLIED)
    with pytest.raises(PhaseFailed) as info:
        orch.offload()
    assert info.value.quarantined == (engines[0].engine,) and "quarantined" in info.value.left_paused[engines[0].engine]
    for transition in (orch.offload, orch.onload, orch.offload):
        with pytest.raises(PhaseFailed) as again:
            transition()
        assert isinstance(again.value.failures[engines[0].engine], EngineSkipped)
    alive(engines)
    assert engines[0].released == set(ALL) and engines[0].paused  # applied, and left alone
    orch.reconcile(engines[0].engine, released=ALL, paused=True)
    orch.onload()
    alive(engines)
    assert all(e.serving for e in engines)


def test_defect_2_ambiguous_resume_is_not_resumed_again(fanout: FanOut) -> None:
    """A resume that may have been applied is not retried by the next onload (a second resume is a KeyError in SGLang)."""
    engines, orch = make(fanout)
    orch.offload()
    engines[1].arm("resume_memory_occupation", Fault.AMBIGUOUS_APPLIED)
    with pytest.raises(PhaseFailed) as info:
        orch.onload()
    assert info.value.quarantined == (engines[1].engine,)
    with pytest.raises(PhaseFailed):
        orch.onload()
    alive(engines)
    assert engines[0].serving and engines[1].paused and not engines[1].released


def test_defect_3_failed_continue_is_not_hidden(fanout: FanOut) -> None:
    """An engine whose continue failed is still offloaded by the next offload (its memory released), not skipped."""
    engines, orch = make(fanout)
    orch.offload()
    engines[0].arm("continue_generation", Fault.FAILED)
    with pytest.raises(PhaseFailed) as info:
        orch.onload()
    assert set(info.value.left_paused) == {engines[0].engine}
    orch.offload()
    alive(engines)
    assert all(e.paused and e.released == set(ALL) for e in engines)


def test_defect_4_ambiguous_continue_is_paused_again(fanout: FanOut) -> None:
    """After an ambiguous continue, a weight sync pauses the engine again before its body runs."""
    engines, orch = make(fanout)
    with orch.weight_sync():
        pass
    orch.offload()
    engines[0].arm("continue_generation", Fault.AMBIGUOUS_APPLIED)
    with pytest.raises(PhaseFailed) as info:
        orch.onload()
    assert "may be paused" in info.value.left_paused[engines[0].engine]
    with orch.weight_sync():
        assert all(e.paused for e in engines)
    alive(engines)
    assert all(e.serving for e in engines)


def test_defect_5_nested_and_concurrent_syncs_hold_their_own_tokens(fanout: FanOut) -> None:
    """The first sync to end does not reopen admission while another still holds its token (nested, or on another thread)."""
    engines, orch = make(fanout)
    with orch.weight_sync():
        with orch.weight_sync():
            pass
        assert all(e.paused for e in engines)
        assert orch.held() == {e.engine: ("weight_sync",) for e in engines}
    assert all(e.serving for e in engines)

    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        with orch.weight_sync():
            inside.set()
            done.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(5)
    with orch.weight_sync():
        pass
    assert all(e.paused for e in engines)  # the other thread's body still runs
    done.set()
    thread.join(5)
    assert all(e.serving for e in engines)
    alive(engines)


def test_defect_6_offload_waits_for_a_running_sync_body(fanout: FanOut) -> None:
    """offload() from another thread starts only after the weight sync body ended; from inside the body it is refused at once."""
    engines, orch = make(fanout)
    started, finish = threading.Event(), threading.Event()
    order: list[str] = []

    def sync() -> None:
        with orch.weight_sync():
            started.set()
            finish.wait(5)
            order.append("body ended")

    thread = threading.Thread(target=sync)
    thread.start()
    assert started.wait(5)
    threading.Timer(0.05, finish.set).start()
    orch.offload()
    order.append("offload done")
    thread.join(5)
    assert order == ["body ended", "offload done"]
    orch.onload(tags=["weights"])  # a sync into released weights is refused
    with orch.weight_sync():
        with pytest.raises(BarrierBusy, match="same thread"):
            orch.onload()
    orch.onload()
    alive(engines)
    assert all(e.serving for e in engines)


def test_exclusion_gives_up_at_the_transition_deadline(fanout: FanOut) -> None:
    """A body that outlives transition_s makes offload raise BarrierBusy, having sent nothing."""
    engines = fakes(fanout, 1)
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=PhaseDeadlines(transition_s=0.05))
    started, finish = threading.Event(), threading.Event()

    def sync() -> None:
        with orch.weight_sync():
            started.set()
            finish.wait(5)

    thread = threading.Thread(target=sync)
    thread.start()
    try:
        assert started.wait(5)
        with pytest.raises(BarrierBusy, match="weight_sync"):
            orch.offload()
        assert engines[0].released == set()
    finally:
        finish.set()
        thread.join(5)
    assert engines[0].serving


def test_defect_7_a_late_pause_is_awaited_before_continue(fanout: FanOut) -> None:
    """A pause still running at the phase deadline is awaited before the engine gets a continue: it is never paused with no hold."""
    engines, orch = make(fanout)
    engines[0].arm("pause_generation", Fault.LATE_APPLIED)
    with pytest.raises(PhaseFailed) as info:
        orch.offload()
    assert engines[0].engine in info.value.left_paused and "late pause_generation" in info.value.left_paused[engines[0].engine]
    assert engines[1].serving  # rolled back
    engines[0].land()
    orch.offload()  # settles the late pause first, then carries on
    orch.onload()
    alive(engines)
    assert all(e.serving for e in engines) and orch.held() == {}


def test_reconcile_and_retire_rules(fanout: FanOut) -> None:
    """reconcile refuses impossible states and retired engines; a retired engine is never named or sent anything again."""
    engines, orch = make(fanout)
    with pytest.raises(ValueError, match="paused=False"):
        orch.reconcile(engines[0], released=["weights"], paused=False)
    with pytest.raises(ValueError, match="subset"):
        orch.reconcile(engines[0], released=["kv"], paused=True)
    with pytest.raises(KeyError, match="nope"):
        orch.reconcile("http://nope:1", released=(), paused=False)
    engines[0].arm("pause_generation", Fault.ACTOR_DIED)
    with pytest.raises(PhaseFailed) as info:
        orch.offload()
    assert info.value.dead == (engines[0].engine,)
    orch.retire(engines[0])
    orch.offload()
    orch.onload()
    with pytest.raises(ValueError, match="retired"):
        orch.reconcile(engines[0], released=(), paused=False)
    assert list(orch.states()) == [engines[1].engine]
    alive(engines)


def test_the_injected_clock_times_transitions_and_phases(fanout: FanOut) -> None:
    """Durations come from the orchestrator's ``clock``: a clock that never moves reports zero for every phase."""
    engines = fakes(fanout, 2)
    seen: list[Event] = []
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, observers=[seen.append], clock=FakeClock())
    report = orch.offload()
    assert [p.phase for p in report.phases] == ["pause", "flush", "release"]
    assert report.duration_s == 0.0 and all(p.duration_s == 0.0 for p in report.phases)
    ended = [e for e in seen if isinstance(e, (PhaseEnded, TransitionEnded))]
    assert len(ended) == 4 and all(e.duration_s == 0.0 for e in ended)
    assert orch.onload().duration_s == 0.0
    alive(engines)
