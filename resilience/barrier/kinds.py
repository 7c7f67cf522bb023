"""Each engine kind's control rules, written down as one table per engine kind (issue 22 §4), over one knowledge model.

The barrier has a single knowledge model (``resilience.barrier.knowledge``:
what is known paused, flushed, released, unknown, held). What differs between
engine kinds is the rules each control call follows, and each kind writes them
down as one ``EngineRules`` table, a row (``CallRule``) per control method:

- ``needs``: what must be *known* before the call is sent (a predicate over the
  engine's knowledge and the tags the call names), and ``needs_text``, the same
  in words;
- ``on_ambiguous``: what an answer that may or may not have been applied does
  (``QUARANTINE``: what it touches becomes unknown and nothing that depends on
  it is sent until a memory probe or the caller proves it; ``RESEND``: it
  becomes unknown and the next transition that needs it sends the call again,
  because repeating it is harmless);
- ``reopens_everyone``: the call ends every pause on the engine, everyone's, so
  it is sent only once no hold remains.

The transitions ask ``BarrierRules.allows(engine, method, tags)``, which looks the
engine's table up (``rules_of``: the engine's ``control_rules`` attribute, else
``SGLANG_RULES``). ``SGLANG_RULES`` is exactly what the barrier did before the
table existed.

SGLang 0.5.23, as its source says (``sglang/srt/managers/scheduler_components/weight_updater.py``,
torch_memory_saver): a second release of a tag exits the process (``exit(1)``), a
resume of a tag not released dies of a ``KeyError`` (``offload_tags.remove``), a
release needs an idle scheduler (paused and flushed), and ``continue_generation``
reopens scheduling for every client, whoever paused it.

Each table also holds its kind's ``MemoryModel`` (``resilience.barrier.memory_model``):
what a release and a resume do to the facts (the tags, whether a release names
them or sleeps them all, whether it needs a flush, whether it pauses, whether a
wake names one tag and whether the last one resumes). The knowledge model folds
each call through it, and the transitions read it (``resilience.barrier.memory``).

vLLM 0.33.0 (``VLLM_RULES``, the calls as ``resilience.adapters.vllm.VLLMEngine``
sends them; reference: ``shared/reference/vllm-control-plane.md``):

- pause = ``/pause``, flush = ``/reset_prefix_cache`` (+ mm, encoder caches),
  release = ``/sleep?level=1&mode=keep`` (both tags), resume = ``/wake_up?tags=T``
  (one tag), continue = ``/resume``;
- an ambiguous sleep or wake is settled by sending it again (``RESEND``: a second
  sleep and a wake of an awake tag are no-ops), no quarantine;
- ``/resume`` (continue) and a wake that leaves nothing asleep reopen everyone's
  pause (``v1/engine/core.py`` l.985, l.1053): continue is sent only with no hold
  left and nothing asleep or unknown; the last wake only with no hold but the
  offload's (``memory.resume_phases``), else that tag stays asleep and the engine
  is reported held;
- tags are tracked here, client-side: no vLLM route reports which tags sleep.
- An ambiguous ``/update_weights`` is not a barrier call: ``resilience.adapters.vllm.weights``
  never re-sends it, asks ``/weight_checker``, or surfaces it.

A third kind: write its ``EngineRules`` (a ``CallRule`` per control method and its
``MemoryModel``), and give its engine class ``control_rules = THAT_TABLE``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from resilience.barrier.engine import CONTROL_METHODS, ControlMethod
from resilience.barrier.fanout import engine_name
from resilience.barrier.knowledge import EngineKnowledge
from resilience.barrier.memory_model import SGLANG_MEMORY, VLLM_MEMORY, MemoryModel

__all__ = ["SGLANG_RULES", "SUPPORTED", "VLLM_RULES", "CallRule", "EngineRules", "OnAmbiguous", "ServingRead", "rules_of"]


class OnAmbiguous(enum.StrEnum):
    """What an ambiguous answer (maybe applied) to a call does."""

    QUARANTINE = "quarantine"
    """What the call touches becomes unknown, and nothing that depends on it is sent until it is proven (a probe, the caller)."""
    RESEND = "resend"
    """What the call touches becomes unknown, and the next transition that needs it sends the call again (harmless to repeat)."""


Needs = Callable[[EngineKnowledge, frozenset[str]], bool]
"""A call's precondition: (the engine's knowledge, the tags the call names) -> known to hold."""


@dataclass(frozen=True, slots=True)
class CallRule:
    """One control method's rules on one engine kind: what it needs, what an ambiguous answer does, whom it reopens."""

    needs: Needs
    needs_text: str
    on_ambiguous: OnAmbiguous
    reopens_everyone: bool = False
    """True when the call ends every pause on the engine, whoever took it: sent only once no hold remains."""
    why: str = ""
    """Where the rule comes from (the engine's source), for the table a person reads."""


@dataclass(frozen=True, slots=True)
class ServingRead:
    """A read an engine kind answers that can prove the engine serves right now (not paused): how a controller that
    resumed a journal tells a fresh process (a restart while no controller watched) from the engine the journal knew.

    ``method``: the engine object's method to call (no arguments; a read, safe to send at any time). ``proves_serving``:
    True when its answer proves the engine is not paused (any other answer, or an error, proves nothing).
    ``why``: where the rule comes from (the engine's source).
    """

    method: str
    proves_serving: Callable[[object], bool]
    why: str = ""


SUPPORTED: Final[Mapping[str, frozenset[OnAmbiguous]]] = {
    "pause_generation": frozenset({OnAmbiguous.RESEND}),
    "flush_cache": frozenset({OnAmbiguous.RESEND}),
    "release_memory_occupation": frozenset({OnAmbiguous.QUARANTINE, OnAmbiguous.RESEND}),
    "resume_memory_occupation": frozenset({OnAmbiguous.QUARANTINE, OnAmbiguous.RESEND}),
    "continue_generation": frozenset({OnAmbiguous.RESEND}),
}
"""What the one knowledge model can do with an ambiguous answer, per method (``EngineKnowledge.apply``): an unknown
"paused" or "flushed" is resolved by sending again; unknown tags are quarantined, or (a ``MemoryModel`` with ``resend``)
settled by sending the release or resume again. A table's release and resume rules must agree with its memory model."""


@dataclass(frozen=True)
class EngineRules:
    """One engine kind's table: a ``CallRule`` for every control method the barrier sends.

    ``kind``: the engine kind's name (for messages). ``calls``: method -> its rule, one for each of
    ``CONTROL_METHODS``. ``source``: the engine version and files the rules were read from. A table
    that misses a method, or asks for what the knowledge model cannot do (``SUPPORTED``), is refused
    with a ``ValueError`` naming it.
    """

    kind: str
    calls: Mapping[ControlMethod, CallRule]
    source: str = ""
    memory: MemoryModel = SGLANG_MEMORY
    """What a release and a resume do to the facts (``resilience.barrier.memory_model``)."""
    serving_read: ServingRead | None = None
    """The read that proves an engine of this kind serves (``ServingRead``); None (default): the kind has none, and a
    journal's "paused" or "released" is checked by the memory probe alone (``resilience.barrier.recovery``)."""

    def __post_init__(self) -> None:
        missing = [m for m in CONTROL_METHODS if m not in self.calls]
        extra = sorted(set(self.calls) - set(CONTROL_METHODS))
        if missing or extra:
            raise ValueError(f"{self.kind} rules must have one row per control method: missing {missing}, unknown {extra}")
        for method, rule in self.calls.items():
            if rule.on_ambiguous not in SUPPORTED[method]:
                raise ValueError(
                    f"{self.kind} rules: {method} on_ambiguous={rule.on_ambiguous} is not something the knowledge model can do "
                    f"yet (it can: {', '.join(sorted(SUPPORTED[method]))}); see resilience.barrier.kinds"
                )
        want = OnAmbiguous.RESEND if self.memory.resend else OnAmbiguous.QUARANTINE
        for method in ("release_memory_occupation", "resume_memory_occupation"):
            if self.calls[method].on_ambiguous is not want:
                raise ValueError(
                    f"{self.kind} rules: {method} on_ambiguous={self.calls[method].on_ambiguous} disagrees with its memory model "
                    f"(resend={self.memory.resend}): the knowledge would {want} instead"
                )

    def allows(self, k: EngineKnowledge, method: ControlMethod, tags: frozenset[str] = frozenset()) -> bool:
        """``method`` (naming ``tags``) may be sent to an engine with knowledge ``k``: its precondition is known to hold,
        and a call that reopens everyone's pause finds no hold left."""
        rule = self.calls[method]
        return rule.needs(k, tags) and not (rule.reopens_everyone and k.holds)

    def table(self) -> str:
        """The rules as a Markdown table (what the docs show)."""
        rows = [f"| {self.kind} call | needs (known before sending) | ambiguous answer | reopens everyone's pause |", "|---|---|---|---|"]
        for method in CONTROL_METHODS:
            rule = self.calls[method]
            rows.append(f"| `{method}` | {rule.needs_text} | {rule.on_ambiguous} | {'yes' if rule.reopens_everyone else 'no'} |")
        return "\n".join(rows)


def _all_tags(predicate: Callable[[EngineKnowledge, str], bool]) -> Needs:
    return lambda k, tags: all(predicate(k, t) for t in tags)


SGLANG_RULES: Final = EngineRules(
    "sglang",
    {
        "pause_generation": CallRule(
            lambda k, _tags: k.reachable,
            "alive, no call in flight (a pause is safe to repeat)",
            OnAmbiguous.RESEND,
            why="pause_generation on a paused scheduler only pauses it again",
        ),
        "flush_cache": CallRule(
            lambda k, _tags: k.may_flush(),
            "known paused",
            OnAmbiguous.RESEND,
            why="flush_cache fails while requests run; repeating it is harmless",
        ),
        "release_memory_occupation": CallRule(
            _all_tags(EngineKnowledge.may_release),
            "known paused and flushed, not quarantined, each tag known not released",
            OnAmbiguous.QUARANTINE,
            why="the scheduler asserts it is idle; a second release of a tag: torch_memory_saver exit(1)",
        ),
        "resume_memory_occupation": CallRule(
            _all_tags(EngineKnowledge.may_resume),
            "not quarantined, each tag known released",
            OnAmbiguous.QUARANTINE,
            why="a resume of a tag not released: KeyError in offload_tags.remove, the server dies",
        ),
        "continue_generation": CallRule(
            lambda k, _tags: k.may_continue(),
            "nothing released or unknown, not known serving, no hold left",
            OnAmbiguous.RESEND,
            reopens_everyone=True,
            why="continue_generation reopens scheduling for every client; onto released memory the next prefill crashes",
        ),
    },
    source="sglang 0.5.23: srt/managers/scheduler_components/weight_updater.py, torch_memory_saver",
    serving_read=ServingRead(
        "ready",
        lambda answer: answer is True,
        why="sglang 0.5.23 srt/entrypoints/http_server.py /ready: 200 only when tokenizer_manager.is_ready(), that is "
        "not is_pause and healthy (srt/managers/tokenizer_manager.py); a fresh process starts with is_pause False",
    ),
)
"""SGLang's control rules: exactly the barrier's behaviour before the tables existed."""

VLLM_RULES: Final = EngineRules(
    "vllm",
    {
        "pause_generation": CallRule(
            lambda k, _tags: k.reachable,
            "alive, no call in flight (/pause is safe to repeat: the last mode wins)",
            OnAmbiguous.RESEND,
            why="rl/online/api_router.py l.31: pause is one shared state, overwritten (scheduler.py l.3073)",
        ),
        "flush_cache": CallRule(
            lambda k, _tags: k.may_flush(),
            "known paused",
            OnAmbiguous.RESEND,
            why="/reset_prefix_cache answers success false while blocks are held; repeating it is harmless",
        ),
        "release_memory_occupation": CallRule(
            _all_tags(EngineKnowledge.may_release),
            "known paused, each tag known not released or unknown (a sleep sleeps both tags; no flush needed)",
            OnAmbiguous.RESEND,
            why="core.py l.993: sleep pauses, clears the caches at level >= 1; abstract.py l.400: a second sleep is a no-op",
        ),
        "resume_memory_occupation": CallRule(
            _all_tags(EngineKnowledge.may_resume),
            "each tag known released or unknown; one tag per call; the last one only with no hold but the offload's",
            OnAmbiguous.RESEND,
            why="abstract.py l.416-422: a tag not asleep makes the whole wake a no-op; core.py l.1053: the last wake resumes",
        ),
        "continue_generation": CallRule(
            lambda k, _tags: k.may_continue(),
            "nothing released or unknown, not known serving, no hold left",
            OnAmbiguous.RESEND,
            reopens_everyone=True,
            why="core.py l.985/l.2235: /resume reopens scheduling for everyone, even while asleep (no guard)",
        ),
    },
    source="vllm 0.33.0: v1/engine/core.py, v1/executor/abstract.py, entrypoints/rl/online/api_router.py",
    memory=VLLM_MEMORY,
    serving_read=ServingRead(
        "is_paused",
        lambda answer: answer is False,
        why="vllm 0.33.0 entrypoints/rl/online/api_router.py /is_paused: scheduler.pause_state != UNPAUSED; /sleep pauses "
        "the scheduler first (v1/engine/core.py l.993), so a paused or asleep engine answers True, a fresh one False",
    ),
)
"""vLLM 0.33.0's control rules, the calls as ``resilience.adapters.vllm.VLLMEngine`` sends them."""


def rules_of(engine: object) -> EngineRules:
    """The table of ``engine``'s kind: its ``control_rules`` attribute, else ``SGLANG_RULES``; anything else is refused."""
    table = getattr(engine, "control_rules", None)
    if table is None:
        return SGLANG_RULES
    if not isinstance(table, EngineRules):
        raise TypeError(f"engine {engine_name(engine)}: control_rules must be a resilience.barrier.kinds.EngineRules, but was {table!r}")
    return table
