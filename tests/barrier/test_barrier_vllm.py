"""The barrier's vLLM rules on socket-free vLLM engines (``fake_vllm_engine``), and one orchestrator over SGLang and vLLM.

Each test names the rule of ``resilience.engine_contract.VLLM_RULES`` it pins; the fakes record what would kill a
real vLLM 0.33.0 engine (scheduling onto slept memory) and what would break a held pause (a ``/resume`` or a
wake that leaves nothing asleep while the test holds one).
"""

from __future__ import annotations

import pytest

from resilience.barrier import EngineGroup, Orchestrator, PhaseDeadlines, PhaseFailed
from resilience.barrier.fanout import ThreadFanOut
from resilience.barrier.journal import Journal, JournalMismatch, knowledge_from
from resilience.engine_contract import ALL_TAGS, SGLANG_RULES, VLLM_RULES, EngineRules, EngineState, rules_of
from tests.barrier.fake_engine import FakeEngine, Fault
from tests.barrier.fake_vllm_engine import VLLM, FakeVLLMEngine

DEADLINES = PhaseDeadlines(transition_s=5.0, pause_s=1.0, flush_s=1.0, release_s=1.0, resume_s=1.0, continue_s=1.0)


def vllm(n: int = 2) -> list[FakeVLLMEngine]:
    return [FakeVLLMEngine(f"http://vllm-{i}:8000") for i in range(n)]


def orchestrator(*groups: EngineGroup[object]) -> Orchestrator[object]:
    return Orchestrator(list(groups), fanout=ThreadFanOut(max_workers=8), deadlines=DEADLINES)


def sound(*engines: FakeEngine) -> None:
    for e in engines:
        assert e.crash is None, f"{e.engine} crashed: {e.crash}"
        assert not e.violations, f"{e.engine}: {e.violations}"


def test_each_engine_has_its_kinds_table() -> None:
    """``control_rules`` picks the table; an engine without one is SGLang; a table whose release and resume disagree with
    its memory model is refused, naming it."""
    assert rules_of(FakeVLLMEngine("a")) is VLLM_RULES and rules_of(FakeEngine("b")) is SGLANG_RULES
    assert VLLM_RULES.memory.resend and not SGLANG_RULES.memory.resend
    with pytest.raises(ValueError, match="disagrees with its memory model"):
        EngineRules("mixed-up", dict(SGLANG_RULES.calls), memory=VLLM_RULES.memory)


def test_offload_sleeps_without_a_flush_and_onload_wakes_weights_then_kv_cache() -> None:
    """RFC #48310's order: pause -> sleep; wake(weights), wake(kv_cache), which resumes: no /resume is sent."""
    engines = vllm()
    orch = orchestrator(EngineGroup(engines))
    orch.offload()
    assert all(e.released == set(VLLM) and e.paused for e in engines)
    assert all(orch.released_tags(e) == VLLM for e in engines)
    orch.onload()
    sound(*engines)
    for e in engines:
        assert e.started == ["pause_generation", "release_memory_occupation", "resume_memory_occupation", "resume_memory_occupation"]
        assert e.serving and e.wakes_that_resumed == 1
    assert all(s is EngineState.SERVING for s in orch.states().values())


def test_a_partial_offload_still_sleeps_every_tag() -> None:
    """vLLM has no per-tag sleep: offload(tags=["kv_cache"]) releases both, and the knowledge says so."""
    engines = vllm(1)
    orch = orchestrator(EngineGroup(engines))
    orch.offload(tags=["kv_cache"])
    assert orch.released_tags(engines[0]) == VLLM == frozenset(engines[0].released)
    orch.onload()
    sound(*engines)
    assert engines[0].serving


def test_the_rfc_transaction_offload_weights_sync_onload() -> None:
    """offload -> onload(weights) -> weight_sync (pushed into awake weights, KV still asleep) -> onload: nothing dies."""
    engines = vllm()
    orch = orchestrator(EngineGroup(engines))
    orch.offload()
    report = orch.onload(tags=["weights"])
    assert all(set(r) == {"offload"} for r in report.held.values())
    with orch.weight_sync() as synced:
        for e in synced:
            assert isinstance(e, FakeVLLMEngine)
            e.push_weights()
    assert all(e.released == {"kv_cache"} and e.paused for e in engines)
    orch.onload()
    sound(*engines)
    assert all(e.serving for e in engines)


@pytest.mark.parametrize("fault", [Fault.AMBIGUOUS_APPLIED, Fault.AMBIGUOUS_NOT_APPLIED, Fault.APPLIED_THEN_502, Fault.APPLIED_THEN_504])
def test_an_ambiguous_sleep_is_settled_by_sending_it_again(fault: Fault) -> None:
    """No quarantine on vLLM: the sleep is sent again (a second sleep is a no-op) and the offload keeps its promise."""
    engines = vllm()
    orch = orchestrator(EngineGroup(engines))
    engines[0].arm("release_memory_occupation", fault)
    orch.offload()
    assert engines[0].started.count("release_memory_occupation") == 2 and engines[1].started.count("release_memory_occupation") == 1
    assert orch.quarantined() == {} and orch.unsettled() == {}
    orch.onload()
    sound(*engines)
    assert all(e.serving for e in engines)


@pytest.mark.parametrize("method_index", [0, 1])
def test_an_ambiguous_wake_is_settled_by_sending_it_again(method_index: int) -> None:
    """The first (weights) or the last (kv_cache) wake is answered ambiguously: it is sent again, one tag, as before."""
    engines = vllm(1)
    orch = orchestrator(EngineGroup(engines))
    orch.offload()
    if method_index == 1:
        orch.onload(tags=["weights"])
    engines[0].arm("resume_memory_occupation", Fault.AMBIGUOUS_APPLIED)
    orch.onload()
    sound(*engines)
    assert engines[0].serving and orch.unsettled() == {}
    assert engines[0].started.count("resume_memory_occupation") == 3


def test_an_unsettled_engine_is_settled_by_the_next_transition() -> None:
    """Every re-send ambiguous too: the offload fails naming it (unsettled, not quarantined); the next offload re-sends."""
    engines = vllm(1)
    orch = orchestrator(EngineGroup(engines))
    e = engines[0]
    original = e.release_memory_occupation
    calls = {"n": 0}

    def flaky(tags: object = None) -> object:
        calls["n"] += 1
        if calls["n"] <= 3:  # the first sleep and both re-sends
            e.arm("release_memory_occupation", Fault.AMBIGUOUS_NOT_APPLIED)
        return original(tags)  # type: ignore[arg-type]

    e.release_memory_occupation = flaky  # type: ignore[method-assign]
    with pytest.raises(PhaseFailed) as info:
        orch.offload()
    assert info.value.quarantined == () and e.engine in info.value.left_paused
    assert orch.states()[e.engine] is EngineState.UNSETTLED
    orch.offload()
    assert orch.released_tags(e) == VLLM and e.released == set(VLLM)
    orch.onload()
    sound(e)
    assert e.serving


def test_the_last_wake_is_not_sent_while_a_user_holds_a_pause() -> None:
    """A wake that leaves nothing asleep resumes vLLM's scheduler for everyone: under a user's hold it is not sent; the
    engine stays held with kv_cache asleep, and the next onload after the hold ends brings it back."""
    engines = vllm()
    orch = orchestrator(EngineGroup(engines))
    orch.offload()
    token = orch.pause("user").hold
    assert token is not None
    for e in engines:
        e.held += 1
    report = orch.onload()
    assert all(set(r) == {"offload", "user"} for r in report.held.values())
    assert all(e.released == {"kv_cache"} and e.paused for e in engines)
    for e in engines:
        e.held -= 1
    orch.unpause(token)
    assert all(e.paused for e in engines)  # the offload's hold keeps it: kv_cache is still asleep
    orch.onload()
    sound(*engines)
    assert all(e.serving for e in engines)


def test_no_resume_or_full_wake_reaches_an_engine_a_weight_sync_holds() -> None:
    """Inside a weight sync (its own hold), an onload from another thread waits; no /resume while a tag sleeps."""
    engines = vllm()
    orch = orchestrator(EngineGroup(engines))
    orch.offload()
    orch.onload(tags=["weights"])
    with orch.weight_sync():
        for e in engines:
            e.held += 1
            e.push_weights()
            e.held -= 1
    assert "continue_generation" not in [m for e in engines for m in e.started]
    orch.onload()
    sound(*engines)


def test_a_weight_sync_body_never_runs_on_an_unsettled_engine() -> None:
    """Memory that may be asleep: the sync refuses (nothing sent), as it does for a quarantined SGLang engine."""
    engines = vllm(1)
    orch = orchestrator(EngineGroup(engines))
    orch.state.know[engines[0].engine].unknown.update(VLLM)
    with pytest.raises(PhaseFailed, match="skipped"), orch.weight_sync():
        raise AssertionError("the body ran")


def test_one_orchestrator_holds_an_sglang_fleet_and_a_vllm_reward_model() -> None:
    """Mixed: SGLang engines release and resume their tags (flushed first); vLLM ones sleep and wake per tag; a weight
    sync pauses all; ambiguous faults on both kinds: SGLang's quarantine, vLLM's re-send."""
    policy = [FakeEngine(f"http://sglang-{i}:30000") for i in range(2)]
    reward = vllm(2)
    orch = orchestrator(EngineGroup(policy, name="policy"), EngineGroup(reward, name="reward"))
    reward[1].arm("release_memory_occupation", Fault.APPLIED_THEN_502)
    orch.offload()
    assert all(e.released == set(ALL_TAGS) for e in policy) and all(e.released == set(VLLM) for e in reward)
    assert policy[0].started == ["pause_generation", "flush_cache", "release_memory_occupation"]
    assert reward[0].started == ["pause_generation", "release_memory_occupation"]
    orch.onload(tags=["weights"])
    with orch.weight_sync() as synced:
        assert len(synced) == 4
        for e in [*policy, *reward]:
            e.push_weights()
    orch.onload()
    sound(*policy, *reward)
    assert all(e.serving for e in [*policy, *reward])
    policy[0].arm("release_memory_occupation", Fault.AMBIGUOUS_APPLIED)
    with pytest.raises(PhaseFailed) as info:
        orch.offload()
    assert info.value.quarantined == (policy[0].engine,)
    sound(*policy, *reward)


def test_the_journal_keeps_a_vllm_engines_knowledge_and_kind(tmp_path: object) -> None:
    """A vLLM engine's facts come back with its kind's rules (an ambiguous wake in flight is folded as vLLM folds it);
    a journal written for a vLLM engine refuses an SGLang engine of the same name."""
    from pathlib import Path

    path = Path(str(tmp_path)) / "barrier.journal"
    engines = vllm(1)
    orch = Orchestrator(EngineGroup(engines), fanout=ThreadFanOut(), deadlines=DEADLINES, journal=path)
    orch.offload()
    orch.onload(tags=["weights"])
    orch.close()
    again = Orchestrator(EngineGroup(engines), fanout=ThreadFanOut(), deadlines=DEADLINES, journal=path)
    k = again.state.know[engines[0].engine]
    assert k.memory is VLLM_RULES.memory and k.released == {"kv_cache"} and k.paused is True
    again.onload()
    sound(*engines)
    assert engines[0].serving
    again.close()
    with pytest.raises(JournalMismatch, match="vllm engine"):
        Journal(path).open([engines[0].engine])
    shown = knowledge_from(engines[0].engine, {"paused": True, "unknown": ["weights"], "kind": "vllm"})
    assert shown.state is EngineState.UNSETTLED  # what cpr journal show reads: the facts' own kind


def test_the_fakes_flag_what_the_vllm_rules_must_never_send() -> None:
    """The property tests can fail: a /resume while asleep kills a fake vLLM engine (a queued request on slept memory); a
    full wake of an awake, paused engine, or a /resume, while a pause is held breaks that pause (a violation)."""
    asleep = FakeVLLMEngine("http://vllm-a:8000")
    asleep.pause_generation()
    asleep.release_memory_occupation()
    asleep.continue_generation()
    assert asleep.crash is not None and "slept memory" in asleep.crash
    held = FakeVLLMEngine("http://vllm-b:8000")
    held.pause_generation()
    held.held = 1
    held.resume_memory_occupation(tags=None)  # nothing asleep: vLLM's wake resumes the scheduler anyway (core.py l.1053)
    assert not held.paused and held.violations and "reopened scheduling" in held.violations[0]
    partial = FakeVLLMEngine("http://vllm-c:8000")
    partial.pause_generation()
    partial.release_memory_occupation()
    partial.resume_memory_occupation(tags=["kv_cache"])
    partial.resume_memory_occupation(tags=["kv_cache"])  # not asleep any more: the whole call is a no-op
    assert partial.released == {"weights"} and partial.paused and partial.crash is None


def test_a_bare_vllm_client_is_refused_naming_the_engine_class_to_use() -> None:
    """``Orchestrator(EngineGroup([VLLMClient(u)]))``: the client has vLLM's routes, not the barrier's calls; the error
    says to wrap it in ``VLLMEngine``. Nothing is sent (the URL is never dialled)."""
    from resilience.adapters.vllm import VLLMClient

    with pytest.raises(TypeError, match="VLLMEngine"):
        Orchestrator(EngineGroup([VLLMClient("http://127.0.0.1:9")]), fanout=ThreadFanOut())
