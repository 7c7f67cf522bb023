"""Each engine kind's rules as one table (``resilience.engine_contract``): SGLang's table is today's behaviour, and a
table is looked up per engine."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from resilience.barrier import ALL_TAGS, EngineGroup, Orchestrator, PhaseDeadlines, PhaseFailed, SequentialFanOut
from resilience.barrier.state import EngineKnowledge, InFlight
from resilience.engine_contract import CONTROL_METHODS, SGLANG_RULES, CallRule, EngineRules, OnAmbiguous, rules_of
from tests.barrier.fake_engine import ALL, FakeEngine

DEADLINES = PhaseDeadlines(transition_s=10.0, pause_s=2, flush_s=2, release_s=2, resume_s=2, continue_s=2)
RELEASE = "release_memory_occupation"


class _Running:
    """A late call that has not landed."""

    def wait(self, timeout: float | None) -> tuple[bool, BaseException | None]:
        return False, None


def knowledge_states() -> list[EngineKnowledge]:
    """Every combination of the facts the preconditions read (tags drawn from two of the three)."""
    tags = [set(), {"kv_cache"}, {"kv_cache", "weights"}]
    out = []
    for paused, flushed, released, unknown, held, dead, in_flight in itertools.product(
        (False, True, None), (False, True), tags, tags[:2], (False, True), (False, True), (False, True)
    ):
        k = EngineKnowledge("e", paused=paused, flushed=flushed, released=set(released), unknown=set(unknown))
        if held:
            k.holds[7] = "user"
        if dead:
            k.dead = "gone"
        if in_flight:
            k.in_flight = InFlight("flush_cache", {}, _Running(), k.facts())
        out.append(k)
    return out


def test_the_sglang_table_is_the_knowledge_model_s_own_preconditions() -> None:
    """For every state: the table allows a call exactly where the barrier's predicates did before the table existed."""
    for k, tags in itertools.product(knowledge_states(), [frozenset({"kv_cache"}), frozenset(ALL)]):
        assert SGLANG_RULES.allows(k, "pause_generation", tags) is k.reachable
        assert SGLANG_RULES.allows(k, "flush_cache", tags) is k.may_flush()
        assert SGLANG_RULES.allows(k, "release_memory_occupation", tags) is all(k.may_release(t) for t in tags)
        assert SGLANG_RULES.allows(k, "resume_memory_occupation", tags) is all(k.may_resume(t) for t in tags)
        assert SGLANG_RULES.allows(k, "continue_generation", tags) is k.may_continue()


def test_the_sglang_table_says_what_an_ambiguous_answer_does_to_the_knowledge() -> None:
    """QUARANTINE rows leave the engine quarantined after an ambiguous answer; RESEND rows leave it unknown but not quarantined."""
    for method in CONTROL_METHODS:
        k = EngineKnowledge("e", paused=True, flushed=True)
        if method == "resume_memory_occupation":
            k.released = set(ALL)
        k.mark(method, {})  # write-ahead: the facts an ambiguous answer leaves
        k.abandon()
        quarantined = SGLANG_RULES.calls[method].on_ambiguous is OnAmbiguous.QUARANTINE
        assert k.quarantined is quarantined, (method, k)
    assert [m for m, r in SGLANG_RULES.calls.items() if r.reopens_everyone] == ["continue_generation"]


def test_the_table_reads_as_one_row_per_call() -> None:
    table = SGLANG_RULES.table()
    assert table.count("\n") == len(CONTROL_METHODS) + 1
    assert "| `release_memory_occupation` | known paused and flushed" in table and "| quarantine | no |" in table
    assert "| `continue_generation` |" in table and table.rstrip().endswith("| resend | yes |")


def test_a_table_must_cover_every_call_and_ask_only_what_the_knowledge_model_can_do() -> None:
    calls = dict(SGLANG_RULES.calls)
    del calls["flush_cache"]
    with pytest.raises(ValueError, match=r"missing \['flush_cache'\]"):
        EngineRules("broken", calls)
    resend = replace(SGLANG_RULES.calls[RELEASE], on_ambiguous=OnAmbiguous.RESEND)
    # a re-sent release needs a memory model whose releases are idempotent (vLLM's), never SGLang's
    with pytest.raises(ValueError, match=r"release_memory_occupation on_ambiguous=resend disagrees with its memory model \(resend=False\)"):
        EngineRules("vllm-like", {**SGLANG_RULES.calls, RELEASE: resend})


class NoRelease(FakeEngine):
    """An engine of a kind whose table never lets a release through (to see the per-engine lookup)."""

    control_rules = EngineRules(
        "no-release",
        {**SGLANG_RULES.calls, RELEASE: CallRule(lambda k, tags: False, "never (a test kind)", OnAmbiguous.QUARANTINE)},
    )


def test_each_engine_is_driven_by_its_own_kind_s_table() -> None:
    sglang, other = FakeEngine("http://fake-0:30000"), NoRelease("http://fake-1:30000")
    assert rules_of(sglang) is SGLANG_RULES and rules_of(other) is NoRelease.control_rules
    orch = Orchestrator(EngineGroup([sglang, other]), fanout=SequentialFanOut(), deadlines=DEADLINES)
    with pytest.raises(PhaseFailed) as failed:
        orch.offload()
    assert "not allowed a release" in str(failed.value.failures[other.engine]) and "never (a test kind)" in str(failed.value)
    assert sglang.snapshot()[2] == frozenset(ALL_TAGS) and other.snapshot()[2] == frozenset()  # SGLang's released, the other never sent
    assert "release_memory_occupation" not in other.started
    orch.onload()
    assert sglang.serving and other.serving


def test_an_engine_whose_control_rules_are_not_a_table_is_refused() -> None:
    class Odd(FakeEngine):
        control_rules = "sglang"

    with pytest.raises(TypeError, match=r"control_rules must be a resilience\.engine_contract\.EngineRules"):
        Orchestrator(EngineGroup([Odd("http://fake-0:30000")]), fanout=SequentialFanOut())
