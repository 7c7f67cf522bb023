"""The engine contract: what an engine is to the barrier, below both the engine clients and the barrier.

Clients (``resilience.adapters.sglang``, ``resilience.adapters.vllm``, Ray's
engines) implement it; the barrier consumes it; it imports nothing from either.
Each engine kind's rules table (``EngineRules``: a ``CallRule`` per control
call, and a ``MemoryModel``) is looked up per engine by ``rules_of``; vLLM's in
words: ``docs/vllm.md``.

The five calls are named after SGLang 0.5.23's HTTP routes, so an engine that
declares no ``control_rules`` is SGLang-shaped by definition and gets
``SGLANG_RULES``. Another kind (vLLM's ``VLLMEngine``) says so with a
``control_rules`` attribute holding its table; a third kind writes its
``EngineRules`` and does the same. Which tags are released on an engine, where a
deployment can prove it, is a ``MemoryProbe``'s answer (NVML, the emulator). What
the barrier announces of an engine to routers beside it (``EngineStateChanged``,
``HoldChanged``) is here too, as routers may not import the barrier.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, TypeAlias, get_args, runtime_checkable

from resilience.events import Event

__all__ = [
    "ALL_TAGS",
    "KNOWLEDGE_NEEDS",
    "CONTROL_METHODS",
    "GATEWAY_STATUSES",
    "MEMORY_MODELS",
    "RESEND_ROUNDS",
    "SGLANG_MEMORY",
    "SGLANG_RULES",
    "SUPPORTED",
    "VLLM_MEMORY",
    "VLLM_RULES",
    "AnyEngine",
    "AsyncControlPlaneEngine",
    "CallRule",
    "ControlMethod",
    "ControlPlaneEngine",
    "EngineDied",
    "EngineRules",
    "EngineState",
    "EngineStateChanged",
    "EngineUnavailable",
    "HoldChanged",
    "KnownFacts",
    "MemoryModel",
    "MemoryProbe",
    "OnAmbiguous",
    "PauseMode",
    "ServingRead",
    "UnknownEngine",
    "covers",
    "engine_name",
    "rules_of",
]

ALL_TAGS: Final[tuple[str, ...]] = ("kv_cache", "weights", "cuda_graph")
"""The memory tags SGLang releases or resumes when ``tags`` is None or empty (``GPU_MEMORY_ALL_TYPES``)."""

PauseMode = Literal["abort", "retract", "in_place"]
"""How ``pause_generation`` treats running requests: abort them, retract them to the queue, or keep them in place."""

ControlMethod = Literal[
    "pause_generation", "flush_cache", "release_memory_occupation", "resume_memory_occupation", "continue_generation"
]
"""The name of one control call."""

CONTROL_METHODS: Final[tuple[ControlMethod, ...]] = get_args(ControlMethod)
"""The five control calls, in the order an offload then an onload sends them."""


class ControlPlaneEngine(Protocol):
    """One engine as the barrier drives it (synchronous calls).

    The barrier passes arguments by keyword, so their names are part of the
    contract (mypy checks them). Each call may block until the engine answered, and should honour the
    ``resilience.Deadline`` in force in the caller's context (the fan-out runs
    each phase call under the phase deadline). The barrier reads nothing from
    what a call returns: a call that returns has been applied, one that raises
    is judged by its error (``resilience.barrier.state.effect_of``).
    """

    def pause_generation(self, *, mode: PauseMode = "abort") -> object:
        """Stop admitting requests; ``mode`` says what happens to running ones."""

    def flush_cache(self, *, deadline_s: float | None = None) -> object:
        """Flush the KV cache, waiting up to ``deadline_s`` (None = the engine's default) for the engine to be idle."""

    def release_memory_occupation(self, *, tags: Sequence[str] | None = None) -> object:
        """Release GPU memory for ``tags`` (None = ``ALL_TAGS``); only on a paused, flushed engine."""

    def resume_memory_occupation(self, *, tags: Sequence[str] | None = None) -> object:
        """Occupy GPU memory again for ``tags`` (None = ``ALL_TAGS``); only for tags released."""

    def continue_generation(self, *, torch_empty_cache: bool = True) -> object:
        """Admit requests again; only when no memory is released."""


class AsyncControlPlaneEngine(Protocol):
    """``ControlPlaneEngine`` with ``async`` calls (same names, arguments and meaning)."""

    async def pause_generation(self, *, mode: PauseMode = "abort") -> object: ...

    async def flush_cache(self, *, deadline_s: float | None = None) -> object: ...

    async def release_memory_occupation(self, *, tags: Sequence[str] | None = None) -> object: ...

    async def resume_memory_occupation(self, *, tags: Sequence[str] | None = None) -> object: ...

    async def continue_generation(self, *, torch_empty_cache: bool = True) -> object: ...


AnyEngine: TypeAlias = ControlPlaneEngine | AsyncControlPlaneEngine
"""An engine with synchronous or ``async`` control calls (``ThreadFanOut`` drives the first kind, ``AsyncFanOut`` both)."""


def engine_name(engine: object) -> str:
    """The name an engine is known by: its ``engine`` attribute (``scheme://host:port``), else ``name``, else repr."""
    for attr in ("engine", "name"):
        value = getattr(engine, attr, None)
        if isinstance(value, str) and value:
            return value
    return repr(engine)


class EngineDied(ConnectionError):
    """The engine (or the actor holding it) is gone: it will not answer again. The call that saw it may still have
    run (Ray says so of a dead actor), so the facts it touches are unknown."""


class EngineUnavailable(ConnectionError):
    """The engine's actor is unreachable for now (Ray's ``ActorUnavailableError``); the call may have run."""


GATEWAY_STATUSES: Final = frozenset({502, 503, 504})
"""Statuses a proxy or gateway answers when it got nothing (usable) from the engine, possibly *after* it forwarded the
request: the engine may have applied the call."""


class EngineState(enum.StrEnum):
    """A one-word summary of an engine's knowledge (for events, ``states()`` and messages)."""

    SERVING = "serving"
    """Known not paused, nothing released."""
    PAUSED = "paused"
    """Known paused, nothing released, not flushed."""
    FLUSHED = "flushed"
    """Known paused and flushed, nothing released."""
    RELEASED = "released"
    """Known paused with some tags known released."""
    UNKNOWN = "unknown"
    """Whether it is paused is unknown (nothing released)."""
    QUARANTINED = "quarantined"
    """Some tags may or may not be released: needs ``reconcile`` or ``retire``."""
    UNSETTLED = "unsettled"
    """Some tags may or may not be released on a ``resend`` kind (vLLM): the next transition re-sends its call."""
    IN_FLIGHT = "in_flight"
    """A call is still running (past its phase deadline, or its phase is under way)."""
    DEAD = "dead"
    """Stopped answering."""
    JOINING = "joining"
    """Added (``add``), not yet in its group's state: no transition covers it, a router keeps it out of rotation."""
    FENCED = "fenced"
    """Out of every transition and of rotation (a join that failed, partial progress) until ``add`` or ``retire``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStateChanged(Event):
    """The orchestrator's view of one engine moved (serving, paused, flushed, released, resumed, dead)."""

    engine: str
    from_state: str
    to_state: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HoldChanged(Event):
    """A pause hold was taken or released on an engine."""

    engine: str
    reason: str
    acquired: bool
    holds: tuple[str, ...]
    """Every reason still holding the engine paused after this change."""


RESEND_ROUNDS: Final = 2
"""How many times a transition re-sends at once an ambiguous release or resume on a ``resend`` kind (then the next does)."""


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """One engine kind's memory semantics; the defaults are SGLang's (``SGLANG_MEMORY``)."""

    kind: str
    tags: tuple[str, ...] = ALL_TAGS
    """The memory tags, in the order onload brings them back."""
    release_whole: bool = False
    """A release releases every tag, whatever it names."""
    flush_before_release: bool = True
    """A release needs a flush first (the engine must be idle)."""
    release_pauses: bool = False
    """A release pauses the engine itself."""
    resend: bool = False
    """Unknown released tags are settled by re-sending the call (idempotent), not quarantined."""
    wake_one_tag: bool = False
    """A resume names one tag per call (a call naming a tag not released does nothing at all)."""
    last_wake_resumes: bool = False
    """A resume that leaves nothing released reopens scheduling, like a continue."""
    all_tags: frozenset[str] = field(init=False, repr=False, compare=False)
    """``tags`` as a set (derived once: read several times per engine per phase)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "all_tags", frozenset(self.tags))

    def release_tags(self, kwargs: Mapping[str, Any]) -> frozenset[str]:
        """The tags a release call with ``kwargs`` releases (None or empty: all of them)."""
        tags = kwargs.get("tags")
        if self.release_whole or not tags:
            return self.all_tags
        return frozenset(tags) & self.all_tags

    def resume_tags(self, kwargs: Mapping[str, Any]) -> frozenset[str]:
        """The tags a resume call with ``kwargs`` names (None or empty: all of them)."""
        tags = kwargs.get("tags")
        return frozenset(tags) & self.all_tags if tags else self.all_tags

    def release_kwargs(self, tags: frozenset[str]) -> dict[str, Any]:
        """The arguments of a release of ``tags`` (None when it is every tag, or on a ``release_whole`` kind)."""
        return {"tags": None if self.release_whole or tags >= self.all_tags else sorted(tags)}


SGLANG_MEMORY: Final = MemoryModel("sglang")
"""SGLang 0.5.23 (why each rule: ``SGLANG_RULES``' rows)."""

VLLM_MEMORY: Final = MemoryModel(
    kind="vllm",
    tags=("weights", "kv_cache"),  # v1/executor/abstract.py l.36
    release_whole=True,  # /sleep sleeps both tags, whatever is asked
    flush_before_release=False,  # /sleep at level >= 1 clears the caches
    release_pauses=True,  # EngineCore.sleep pauses first (v1/engine/core.py l.993)
    resend=True,  # a second sleep and a wake of an awake tag are no-ops (abstract.py l.400, l.416-422)
    wake_one_tag=True,  # a wake naming a tag not asleep wakes nothing: one tag per call makes a re-send exact (RFC #48310)
    last_wake_resumes=True,  # a wake that leaves nothing asleep resumes scheduling, whoever paused (core.py l.1053)
)
"""vLLM 0.33.0 driven through ``resilience.adapters.vllm.VLLMEngine``."""

MEMORY_MODELS: Final[Mapping[str, MemoryModel]] = {m.kind: m for m in (SGLANG_MEMORY, VLLM_MEMORY)}
"""Every memory model, by kind (what a journal's ``kind`` names)."""


class UnknownEngine(LookupError):
    """Raised by ``MemoryProbe.released_tags`` for an engine the probe knows nothing of (distinct from None: no reading now)."""

    def __init__(self, probe: object, engine: str) -> None:
        super().__init__(f"{probe!r} knows no engine {engine!r}")
        self.engine = engine
        """The engine asked about."""


@runtime_checkable
class MemoryProbe(Protocol):
    """Answers which memory tags (``kv_cache``, ``weights``, ``cuda_graph``) are released on an engine, where a deployment
    can prove it.

    SGLang 0.5.23 has no route that tells, so a probe answers from outside the HTTP
    control plane (NVML: ``resilience.adapters.nvml``; the emulator's own truth:
    ``resilience.testing``); ``docs/failure-and-recovery.md`` says who asks it. A
    probe never guesses: ``None`` means "I know this engine but cannot prove it
    now", and the caller behaves as without a probe; an engine it cannot read at all
    raises ``UnknownEngine`` instead (``covers``). Probes are synchronous and quick
    (a local read); async callers may call them directly.
    """

    def released_tags(self, engine: str) -> frozenset[str] | None:
        """The tags released on ``engine`` (its name, ``scheme://host:port``) now, or None when this probe cannot prove it.

        Raises ``UnknownEngine`` when the probe has no way to read ``engine`` at all.
        """
        ...


def covers(probe: MemoryProbe, engine: str) -> bool:
    """Whether ``probe`` knows ``engine``: one ``released_tags`` call answers a reading, None or another error, not ``UnknownEngine``.

    Another error counts as known (the probe may read the engine later), as the callers treat it.
    """
    try:
        probe.released_tags(engine)
    except UnknownEngine:
        return False
    except Exception:
        return True
    return True


class OnAmbiguous(enum.StrEnum):
    """What an ambiguous answer (ambiguous) to a call does."""

    QUARANTINE = "quarantine"
    """What the call touches becomes unknown, and nothing that depends on it is sent until it is proven (a probe, the caller)."""
    RESEND = "resend"
    """What the call touches becomes unknown, and the next transition that needs it sends the call again (harmless to repeat)."""


class KnownFacts(Protocol):
    """What a rule's precondition reads of one engine: questions ``resilience.barrier.state.EngineKnowledge`` answers."""

    @property
    def reachable(self) -> bool: ...

    @property
    def holds(self) -> Mapping[int, str]: ...

    def may_flush(self) -> bool: ...

    def may_release(self, tag: str) -> bool: ...

    def may_resume(self, tag: str) -> bool: ...

    def may_continue(self) -> bool: ...


Needs = Callable[[KnownFacts, frozenset[str]], bool]
"""A call's precondition: (the engine's knowledge, the tags the call names) -> known to hold."""


@dataclass(frozen=True, slots=True)
class CallRule:
    """One control method's rules on one engine kind: what it needs, what an ambiguous answer does, whom it reopens."""

    needs: Needs
    """What must be known before the call is sent."""
    needs_text: str
    """``needs`` in words."""
    on_ambiguous: OnAmbiguous
    """What an answer that may or may not have been applied does."""
    reopens_everyone: bool = False
    """True when the call ends every pause on the engine, whoever took it: sent only once no hold remains."""
    why: str = ""
    """Where the rule comes from (the engine's source), for the table a person reads."""


@dataclass(frozen=True, slots=True)
class ServingRead:
    """A read that can prove an engine of a kind serves right now (not paused): how a controller that resumed a journal
    tells a fresh process (a restart while no controller watched) from the engine the journal knew."""

    method: str
    """The engine object's method to call (no arguments; a read, safe to send at any time)."""
    proves_serving: Callable[[object], bool]
    """True when its answer proves the engine is not paused (any other answer, or an error, proves nothing)."""
    why: str = ""
    """Where the rule comes from (the engine's source)."""


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


_MEMORY_CALLS: Final[tuple[ControlMethod, ...]] = ("release_memory_occupation", "resume_memory_occupation")


@dataclass(frozen=True)
class EngineRules:
    """One engine kind's table; one that misses a method, or asks for what the knowledge model cannot do
    (``SUPPORTED``), is refused with a ``ValueError`` naming it."""

    kind: str
    """The engine kind's name (for messages)."""
    calls: Mapping[ControlMethod, CallRule]
    """Method -> its rule, one for each of ``CONTROL_METHODS``."""
    source: str = ""
    """The engine version and files the rules were read from."""
    memory: MemoryModel = SGLANG_MEMORY
    """What a release and a resume do to the facts (``MemoryModel``)."""
    serving_read: ServingRead | None = None
    """The read that proves an engine of this kind serves (``ServingRead``); None (default): the kind has none, and a
    journal's "paused" or "released" is checked by the memory probe alone (``resilience.barrier.transitions.resume``)."""

    def __post_init__(self) -> None:
        missing = [m for m in CONTROL_METHODS if m not in self.calls]
        extra = sorted(set(self.calls) - set(CONTROL_METHODS))
        if missing or extra:
            raise ValueError(f"{self.kind} rules must have one row per control method: missing {missing}, unknown {extra}")
        for method, rule in self.calls.items():
            if rule.on_ambiguous not in SUPPORTED[method]:
                raise ValueError(
                    f"{self.kind} rules: {method} on_ambiguous={rule.on_ambiguous} is not something the knowledge model can do "
                    f"yet (it can: {', '.join(sorted(SUPPORTED[method]))}); see resilience.engine_contract"
                )
        want = OnAmbiguous.RESEND if self.memory.resend else OnAmbiguous.QUARANTINE
        for method in _MEMORY_CALLS:
            if self.calls[method].on_ambiguous is not want:
                raise ValueError(
                    f"{self.kind} rules: {method} on_ambiguous={self.calls[method].on_ambiguous} disagrees with its memory model "
                    f"(resend={self.memory.resend}): the knowledge would {want} instead"
                )

    def allows(self, k: KnownFacts, method: ControlMethod, tags: frozenset[str] = frozenset()) -> bool:
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


KNOWLEDGE_NEEDS: Final[Mapping[ControlMethod, Needs]] = {
    "pause_generation": lambda k, _tags: k.reachable,
    "flush_cache": lambda k, _tags: k.may_flush(),
    "release_memory_occupation": lambda k, tags: all(k.may_release(t) for t in tags),
    "resume_memory_occupation": lambda k, tags: all(k.may_resume(t) for t in tags),
    "continue_generation": lambda k, _tags: k.may_continue(),
}
"""Each control call's precondition as the one knowledge model states it: the ``needs`` of every row of both tables (the
kinds differ in their ``MemoryModel``, not in these questions)."""


def _rules(kind: str, rows: Mapping[ControlMethod, tuple[str, str]], memory: MemoryModel = SGLANG_MEMORY, **table: Any) -> EngineRules:
    """A table whose rows ask ``KNOWLEDGE_NEEDS``: ``rows`` maps each method to (needs_text, why). An ambiguous answer is
    re-sent, but for a release or resume on a kind without ``resend`` (quarantined: what ``SUPPORTED`` and the memory
    model allow); ``continue_generation`` reopens everyone's pause; ``table``: ``EngineRules``' other fields."""
    on_memory = OnAmbiguous.RESEND if memory.resend else OnAmbiguous.QUARANTINE
    calls = {
        m: CallRule(KNOWLEDGE_NEEDS[m], text, on_memory if m in _MEMORY_CALLS else OnAmbiguous.RESEND, m == "continue_generation", why)
        for m, (text, why) in rows.items()
    }
    return EngineRules(kind, calls, memory=memory, **table)


SGLANG_RULES: Final = _rules(
    "sglang",
    {
        "pause_generation": (
            "alive, no call in flight (a pause is safe to repeat)",
            "pause_generation on a paused scheduler only pauses it again",
        ),
        "flush_cache": ("known paused", "flush_cache fails while requests run; repeating it is harmless"),
        "release_memory_occupation": (
            "known paused and flushed, not quarantined, each tag known not released",
            "the scheduler asserts it is idle; a second release of a tag: torch_memory_saver exit(1)",
        ),
        "resume_memory_occupation": (
            "not quarantined, each tag known released",
            "a resume of a tag not released: KeyError in offload_tags.remove, the server dies",
        ),
        "continue_generation": (
            "nothing released or unknown, not known serving, no hold left",
            "continue_generation reopens scheduling for every client; onto released memory the next prefill crashes",
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

VLLM_RULES: Final = _rules(
    "vllm",
    {
        "pause_generation": (
            "alive, no call in flight (/pause is safe to repeat: the last mode wins)",
            "rl/online/api_router.py l.31: pause is one shared state, overwritten (scheduler.py l.3073)",
        ),
        "flush_cache": ("known paused", "/reset_prefix_cache answers success false while blocks are held; repeating it is harmless"),
        "release_memory_occupation": (
            "known paused, each tag known not released or unknown (a sleep sleeps both tags; no flush needed)",
            "core.py l.993: sleep pauses, clears the caches at level >= 1; abstract.py l.400: a second sleep is a no-op",
        ),
        "resume_memory_occupation": (
            "each tag known released or unknown; one tag per call; the last one only with no hold but the offload's",
            "abstract.py l.416-422: a tag not asleep makes the whole wake a no-op; core.py l.1053: the last wake resumes",
        ),
        "continue_generation": (
            "nothing released or unknown, not known serving, no hold left",
            "core.py l.985/l.2235: /resume reopens scheduling for everyone, even while asleep (no guard)",
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
    """The table of ``engine``'s kind: its ``control_rules`` attribute (anything but an ``EngineRules`` there is refused),
    else ``SGLANG_RULES`` (the module docstring says why)."""
    table = getattr(engine, "control_rules", None)
    if table is None:
        return SGLANG_RULES
    if not isinstance(table, EngineRules):
        raise TypeError(f"engine {engine_name(engine)}: control_rules must be a resilience.engine_contract.EngineRules, but was {table!r}")
    return table
