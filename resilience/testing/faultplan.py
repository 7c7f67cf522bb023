"""Fault plans: which request on which engine gets which fault (pure logic, no sockets).

A :class:`FaultPlan` is a seed and an ordered tuple of :class:`FaultRule`; a :class:`FaultDecider` applies it to
one engine's requests and answers a :class:`Decision` per request, which the fault proxy carries out. A
probabilistic decision is a pure function of ``(seed, engine_index, rule index, path, call index)`` (the call
index counts requests to that path on that engine): the same seed and per-path request sequence give the same
faults in any process, however other paths interleave. Swap windows (kind ``window``) are the one time-based kind.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

from resilience._files import read_data_file
from resilience.errors import ConfigError

__all__ = [
    "AMBIGUOUS_PATHS",
    "CONTROL_PATHS",
    "VLLM_AMBIGUOUS_PATHS",
    "VLLM_CONTROL_PATHS",
    "Decision",
    "FaultDecider",
    "FaultKind",
    "FaultPlan",
    "FaultPlanError",
    "FaultRule",
]

FaultKind = Literal["status_before", "status_after", "reset_before", "reset_after", "drop_after", "hang_after", "latency", "hang", "window"]
"""What a rule does to a request it selects.

- ``status_before``: answer ``status`` (empty body) without forwarding; the engine never sees it.
- ``status_after``: forward, wait for the engine's whole answer, discard it, answer ``status``:
  the engine acted but the client sees an error (an ambiguous outcome).
- ``reset_before``: reset the client connection (TCP RST) without forwarding.
- ``reset_after``: forward, let the engine answer, then reset the client connection.
- ``drop_after``: forward, then reset the client connection as soon as the request is sent; the proxy still
  reads the engine's answer, so the engine may act *after* the client saw the reset (a late effect, ambiguous;
  ``FaultProxy.settle()`` waits for such calls).
- ``hang_after``: forward, let the engine act and answer, never answer the client (a read timeout after sending,
  ambiguous); held until the client gives up, ``delay`` passes or the proxy stops.
- ``latency``: sleep ``delay`` seconds, then forward normally.
- ``hang``: never answer; hold the connection until the proxy stops or ``delay`` passes, then close.
- ``window``: a swap window. Once a selected request to ``path`` is forwarded, every request to ``paths`` in the next
  ``delay`` seconds is answered ``status`` without forwarding (the seed's nginx while SGLang swaps memory).
"""

_KINDS: Final[tuple[str, ...]] = get_args(FaultKind)
_STATUS_KINDS: Final = frozenset({"status_before", "status_after", "window"})
_DELAY_REQUIRED: Final = frozenset({"latency", "window"})
_DELAY_ALLOWED: Final = _DELAY_REQUIRED | {"hang", "hang_after"}
_AFTER_SENDING: Final = frozenset({"status_after", "reset_after", "drop_after", "hang_after"})
_FAILING: Final = frozenset(_KINDS) - {"latency"}  # what ``FaultPlan.max_streak`` counts
DEFAULT_STATUS: Final = 502
"""The status answered by status-answering kinds when ``status`` is None: nginx's Bad Gateway."""

CONTROL_PATHS: Final[tuple[str, ...]] = (
    *("/pause_generation", "/continue_generation", "/flush_cache"),
    *("/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_tensor"),
)
"""The per-step SGLang control endpoints the seed's colocate loop calls (Bug A)."""

_IDEMPOTENT_CONTROL: Final = ("/pause_generation", "/continue_generation", "/flush_cache")

AMBIGUOUS_PATHS: Final[tuple[str, ...]] = ("/release_memory_occupation", "/resume_memory_occupation", "/continue_generation")
"""Where ``FaultPlan.seed_like(..., ambiguous=p)`` puts faults after the engine acted: the calls whose
repetition (release, resume) or misreading (continue) crashes or endangers an engine."""

VLLM_CONTROL_PATHS: Final[tuple[str, ...]] = (
    *("/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache"),
    *("/start_weight_update", "/update_weights", "/finish_weight_update"),
)
"""The control calls of vLLM 0.33.0's RL transaction (RFC #48310): pause, sleep, wake, the weight session, cache reset, resume."""

_VLLM_IDEMPOTENT_CONTROL: Final = ("/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache")
"""vLLM's memory and pause transitions: a repeat is a no-op (``vllm-control-plane.md`` section 5)."""

VLLM_AMBIGUOUS_PATHS: Final[tuple[str, ...]] = ("/sleep", "/wake_up", "/update_weights", "/finish_weight_update")
"""Where ``FaultPlan.vllm_like(..., ambiguous=p)`` puts faults after the engine acted: the memory transitions
(settled by re-sending them) and the weight calls (never re-sent: ``/update_weights`` is a collective)."""


def _control_faults(
    paths: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str], rate: float, slow_swap: float, ambiguous: float, after: float
) -> tuple[FaultRule, ...]:
    """The rules of :meth:`FaultPlan.seed_like` and :meth:`FaultPlan.vllm_like`, in the order they are tried.

    ``paths``: the ambiguous paths, the control paths, the idempotent ones among them, the path slowed half the time.
    """
    for name, value in (("rate", rate), ("ambiguous", ambiguous), ("status_after", after)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise _fail(name, "a number between 0 and 1", value)
    ambiguous_paths, control_paths, idempotent, swap = paths
    rules: list[FaultRule] = []
    if ambiguous:
        rules += [FaultRule(p, "drop_after", probability=ambiguous) for p in ambiguous_paths]
        rules += [FaultRule(p, "hang_after", probability=ambiguous / 4, delay=30.0) for p in ambiguous_paths]
    if after:
        rules += [FaultRule(p, "status_after", status=502, probability=after) for p in ambiguous_paths]
        rules += [FaultRule(p, "status_after", status=504, probability=after / 2) for p in ambiguous_paths]
    rules += [FaultRule(p, "status_before", probability=rate) for p in control_paths]
    rules += [FaultRule(p, "reset_before", probability=rate / 10) for p in idempotent]
    rules.append(FaultRule(swap, "latency", probability=0.5, delay=slow_swap))
    return tuple(rules)


class FaultPlanError(ConfigError):
    """A fault rule or plan (or plan file) is invalid; the message names the file, rule and field."""


def _fail(field: str, rule: str, value: object) -> FaultPlanError:
    return FaultPlanError(f"`{field}` must be {rule}, but was {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_set(name: str, value: object, minimum: int) -> frozenset[int] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _fail(name, f"a set of integers >= {minimum}", value)
    items = tuple(value)
    if not items or not all(_is_int(v) and v >= minimum for v in items):
        raise _fail(name, f"a non-empty set of integers >= {minimum}", value)
    return frozenset(items)


def _check_path(name: str, value: object) -> None:
    if not isinstance(value, str) or not (value == "*" or value.startswith("/")) or "?" in value:
        raise _fail(name, 'an exact path starting with "/" (no query) or "*"', value)


@dataclass(frozen=True, slots=True)
class FaultRule:
    """One fault, the requests it selects, and how often; an invalid value raises :class:`FaultPlanError` naming the field.

    A request is selected when its path matches, its engine is listed, ``max_count`` is not reached, its call index
    is in ``calls`` and the seeded draw is below ``probability`` (each when set).
    """

    path: str
    """Exact request path (no query), or ``"*"`` for every path; for ``window`` rules the trigger path."""

    kind: FaultKind
    """What happens to a selected request; see :data:`FaultKind`."""

    status: int | None = None
    """Status answered (200..599) by ``status_before``, ``status_after`` and ``window``; None = 502. Unset for other kinds."""

    probability: float | None = None
    """Chance (0..1) that a matching request is selected, from the plan's seeded per-path stream. None = always."""

    calls: Set[int] | None = None
    """1-based call indices of the path on the engine that are eligible (``{1, 2}``: the first two; a ``"*"`` rule
    counts each path's own). None = every call."""

    engines: Set[int] | None = None
    """Engine indices the rule applies to. None = all engines."""

    max_count: int | None = None
    """Most injections per engine (``window``: requests answered inside windows); 0 disables the rule. None = no cap."""

    delay: float | None = None
    """Seconds: the sleep of ``latency`` and the length of a ``window`` (required, > 0); for ``hang`` and
    ``hang_after`` the hold before closing (None = until the client gives up). Unset for other kinds."""

    paths: Set[str] = frozenset()
    """``window`` only: paths answered ``status`` while the window is open; empty = every path."""

    def __post_init__(self) -> None:
        _check_path("path", self.path)
        if self.kind not in _KINDS:
            raise _fail("kind", "one of " + ", ".join(_KINDS), self.kind)
        if self.status is not None:
            if self.kind not in _STATUS_KINDS:
                raise _fail("status", f"unset for kind {self.kind!r} (it answers no status)", self.status)
            if not _is_int(self.status) or not 200 <= self.status <= 599:
                raise _fail("status", "an integer between 200 and 599", self.status)
        p = self.probability
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                raise _fail("probability", "a number between 0 and 1", p)
            object.__setattr__(self, "probability", float(p))
        object.__setattr__(self, "calls", _int_set("calls", self.calls, 1))
        object.__setattr__(self, "engines", _int_set("engines", self.engines, 0))
        if self.max_count is not None and (not _is_int(self.max_count) or self.max_count < 0):
            raise _fail("max_count", "an integer >= 0 or None", self.max_count)
        d = self.delay
        if d is None:
            if self.kind in _DELAY_REQUIRED:
                raise _fail("delay", f"set (seconds > 0) for kind {self.kind!r}", d)
        else:
            if self.kind not in _DELAY_ALLOWED:
                raise _fail("delay", f"unset for kind {self.kind!r}", d)
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not (0 < d and math.isfinite(d)):
                raise _fail("delay", "a finite number of seconds > 0", d)
            object.__setattr__(self, "delay", float(d))
        if isinstance(self.paths, (str, bytes)) or not isinstance(self.paths, Iterable):
            raise _fail("paths", "a set of paths", self.paths)
        paths = frozenset(self.paths)
        if paths and self.kind != "window":
            raise _fail("paths", f"empty for kind {self.kind!r} (only window rules use it)", self.paths)
        for item in paths:
            _check_path("paths", item)
        object.__setattr__(self, "paths", paths)

    @property
    def answer_status(self) -> int | None:
        """The status this rule answers (``status`` or 502), or None for kinds that answer none."""
        if self.kind not in _STATUS_KINDS:
            return None
        return DEFAULT_STATUS if self.status is None else self.status

    def matches(self, path: str, engine_index: int) -> bool:
        """Whether a request to ``path`` on engine ``engine_index`` is this rule's (trigger) path."""
        return (self.path == "*" or self.path == path) and (self.engines is None or engine_index in self.engines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON/TOML/YAML-ready mapping of the set fields (sets as sorted lists); inverse of loading."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name == "paths" and not value):
                continue
            out[f.name] = sorted(value) if isinstance(value, frozenset) else value
        return out


_RULE_FIELDS: Final = frozenset(f.name for f in dataclasses.fields(FaultRule))
_PLAN_KEYS: Final = frozenset({"seed", "rules", "max_streak"})


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """A seed and an ordered tuple of rules: the faults one run injects, reproducibly.

    The first rule that selects a request wins; an open swap window takes precedence. Build one in Python, with
    :meth:`load` from a file, or with a preset (:meth:`seed_like`, :meth:`vllm_like`, :meth:`ambiguous_release`).
    """

    seed: int
    """Seed of every probabilistic draw."""

    rules: tuple[FaultRule, ...] = ()
    """The rules, in priority order. Empty = no faults."""

    max_streak: int | None = None
    """At most this many consecutive requests to one path on one engine fail by a fault (any kind but ``latency``):
    a client making ``max_streak + 1`` attempts always gets through. None = no cap."""

    def __post_init__(self) -> None:
        if not _is_int(self.seed):
            raise _fail("seed", "an integer", self.seed)
        if isinstance(self.rules, (str, bytes, Mapping)) or not isinstance(self.rules, Iterable):
            raise _fail("rules", "a sequence of FaultRule", self.rules)
        rules = tuple(self.rules)
        for i, rule in enumerate(rules):
            if not isinstance(rule, FaultRule):
                raise _fail(f"rules[{i}]", "a FaultRule", rule)
        object.__setattr__(self, "rules", rules)
        if self.max_streak is not None and (not _is_int(self.max_streak) or self.max_streak < 1):
            raise _fail("max_streak", "an integer >= 1 or None", self.max_streak)

    def to_dict(self) -> dict[str, Any]:
        """A JSON/TOML/YAML-ready mapping; ``FaultPlan.from_dict(plan.to_dict()) == plan``."""
        out: dict[str, Any] = {"seed": self.seed, "rules": [r.to_dict() for r in self.rules]}
        if self.max_streak is not None:
            out["max_streak"] = self.max_streak
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<plan>") -> FaultPlan:
        """Build a plan from a mapping shaped like :meth:`to_dict` (unknown keys rejected); ``source`` names it in errors."""
        if not isinstance(data, Mapping):
            raise FaultPlanError(f"{source}: a plan must be a mapping, but was {type(data).__name__}")
        unknown = sorted(set(data) - _PLAN_KEYS)
        if unknown:
            raise FaultPlanError(f"{source}: unknown key `{unknown[0]}`; allowed: {', '.join(sorted(_PLAN_KEYS))}")
        if "seed" not in data:
            raise FaultPlanError(f"{source}: `seed` is required (faults must be reproducible)")
        raw_rules = data.get("rules", [])
        if not isinstance(raw_rules, list):
            raise FaultPlanError(f"{source}: `rules` must be a list, but was {raw_rules!r}")
        allowed = _RULE_FIELDS
        rules: list[FaultRule] = []
        for i, raw in enumerate(raw_rules):
            where = f"{source}: rules[{i}]"
            if not isinstance(raw, Mapping):
                raise FaultPlanError(f"{where}: a rule must be a mapping, but was {raw!r}")
            where += f" (path={raw.get('path')!r}, kind={raw.get('kind')!r})"
            bad = sorted(set(raw) - allowed)
            if bad:
                raise FaultPlanError(f"{where}: unknown key `{bad[0]}`; allowed: {', '.join(sorted(allowed))}")
            missing = [k for k in ("path", "kind") if k not in raw]
            if missing:
                raise FaultPlanError(f"{where}: `{missing[0]}` is required")
            try:
                rules.append(FaultRule(**dict(raw)))
            except FaultPlanError as exc:
                raise FaultPlanError(f"{where}: {exc}") from None
        try:
            return cls(seed=data["seed"], rules=tuple(rules), max_streak=data.get("max_streak"))
        except FaultPlanError as exc:
            raise FaultPlanError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> FaultPlan:
        """Read a plan from a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file; errors name the file, rule and field."""
        data = read_data_file(path, what="fault plan", suffixes=(".toml", ".yaml", ".yml", ".json"), error=FaultPlanError)
        return cls.from_dict(data, source=str(Path(path)))

    @classmethod
    def seed_like(
        cls, seed: int, rate: float = 0.3, *, slow_swap: float = 0.2, ambiguous: float = 0.0, status_after: float = 0.0
    ) -> FaultPlan:
        """The faults of the second seed's Bug A: transient 502s on the per-step control calls.

        - ``status_before`` 502 (not forwarded) with probability ``rate`` on every path of :data:`CONTROL_PATHS`.
        - ``reset_before`` with probability ``rate / 10`` on the idempotent ones (pause, continue, flush) only: a
          reset after sending a release or resume is ambiguous (:meth:`ambiguous_release` covers that case).
        - ``latency`` of ``slow_swap`` seconds (default 0.2) on half the ``/resume_memory_occupation`` calls.
        - ``max_streak=2``: a client with 3 attempts (the seed's fix) always survives; one without retries fails.
        - ``ambiguous`` (default 0 = none): faults *after* the engine acted on :data:`AMBIGUOUS_PATHS`, tried first:
          ``drop_after`` with probability ``ambiguous``, ``hang_after`` with ``ambiguous / 4`` (held at most 30 s). A
          client that re-sends release or resume after them kills the engine.
        - ``status_after`` (default 0 = none): on :data:`AMBIGUOUS_PATHS`, tried next, 502 with probability
          ``status_after`` and 504 with ``status_after / 2`` after the engine applied the call; a client that reads
          the 5xx as "not applied" and re-sends kills the engine.
        """
        paths = (AMBIGUOUS_PATHS, CONTROL_PATHS, _IDEMPOTENT_CONTROL, "/resume_memory_occupation")
        return cls(seed=seed, rules=_control_faults(paths, rate, slow_swap, ambiguous, status_after), max_streak=2)

    @classmethod
    def vllm_like(cls, seed: int, rate: float = 0.3, *, slow_swap: float = 0.2, ambiguous: float = 0.0) -> FaultPlan:
        """:meth:`seed_like`'s faults on vLLM 0.33.0's control calls (:data:`VLLM_CONTROL_PATHS`).

        ``reset_before`` goes to the idempotent ones (pause, resume, sleep, wake_up, reset_prefix_cache), ``latency``
        to half the ``/wake_up`` calls, ``ambiguous`` faults to :data:`VLLM_AMBIGUOUS_PATHS` (a re-sent sleep or wake
        is harmless; a re-sent ``/update_weights`` or ``/finish_weight_update`` is not). ``max_streak=2``.
        """
        paths = (VLLM_AMBIGUOUS_PATHS, VLLM_CONTROL_PATHS, _VLLM_IDEMPOTENT_CONTROL, "/wake_up")
        return cls(seed=seed, rules=_control_faults(paths, rate, slow_swap, ambiguous, 0.0), max_streak=2)

    @classmethod
    def ambiguous_release(cls, seed: int, *, calls: Set[int] = frozenset({1})) -> FaultPlan:
        """The engine releases memory but the client sees 502: ``status_after`` on the ``calls`` (default: the first)
        ``/release_memory_occupation`` of every engine. Re-sending it blindly releases twice, which kills the engine."""
        rule = FaultRule("/release_memory_occupation", "status_after", calls=calls)
        return cls(seed=seed, rules=(rule,))


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with one request, as decided by :meth:`FaultDecider.decide`."""

    path: str
    call_index: int
    """1-based index of this request among the engine's requests to ``path``."""
    kind: FaultKind | None = None
    """The fault to inject, or None to forward untouched."""
    status: int | None = None
    """The status to answer for status-answering kinds, else None."""
    delay: float | None = None
    """The rule's ``delay`` (latency sleep, hang hold, window length), else None."""
    rule_index: int | None = None
    """Index in ``plan.rules`` of the rule that fired, else None."""
    opens: tuple[int, ...] = ()
    """Window rules (indices) whose window opens once this request is forwarded."""

    @property
    def forwards(self) -> bool:
        """Whether the request reaches the engine."""
        return self.kind is None or self.kind in _AFTER_SENDING or self.kind == "latency"


class FaultDecider:
    """Applies one plan to the request stream of one engine; thread-safe. All state lives here, never in the plan.

    ``clock`` (default :func:`time.monotonic`) times swap windows (a fake clock tests them without sleeping).
    """

    def __init__(self, plan: FaultPlan, engine_index: int = 0, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not _is_int(engine_index) or engine_index < 0:
            raise _fail("engine_index", "an integer >= 0", engine_index)
        self.plan: Final = plan
        self.engine_index: Final = engine_index
        self._clock = clock
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._injected = [0] * len(plan.rules)
        self._window_until: dict[int, float] = {}
        self._streak: dict[str, int] = {}

    def _draw(self, rule_index: int, path: str, call_index: int) -> float:
        key = f"{self.plan.seed}:{self.engine_index}:{rule_index}:{path}:{call_index}"
        return random.Random(key).random()

    def _selected(self, i: int, rule: FaultRule, path: str, call: int) -> bool:
        if not rule.matches(path, self.engine_index):
            return False
        if rule.calls is not None and call not in rule.calls:
            return False
        return rule.probability is None or self._draw(i, path, call) < rule.probability

    def _capped(self, i: int, rule: FaultRule) -> bool:
        return rule.max_count is not None and self._injected[i] >= rule.max_count

    def _in_window(self, i: int, rule: FaultRule, path: str, now: float) -> bool:
        until = self._window_until.get(i)
        return until is not None and now < until and (not rule.paths or path in rule.paths) and not self._capped(i, rule)

    def decide(self, path: str) -> Decision:
        """Count this request to ``path`` and decide its fault; call once per request."""
        with self._lock:
            call = self._calls.get(path, 0) + 1
            self._calls[path] = call
            rules = self.plan.rules
            opens = tuple(i for i, r in enumerate(rules) if r.kind == "window" and self._selected(i, r, path, call))
            chosen: int | None = None
            now = self._clock()
            for i, rule in enumerate(rules):
                if rule.kind == "window" and self._in_window(i, rule, path, now):
                    chosen = i
                    break
            if chosen is None:
                for i, rule in enumerate(rules):
                    if rule.kind != "window" and not self._capped(i, rule) and self._selected(i, rule, path, call):
                        chosen = i
                        break
            streak = self._streak.get(path, 0)
            limit = self.plan.max_streak
            if chosen is not None and rules[chosen].kind in _FAILING and limit is not None and streak >= limit:
                chosen = None
            if chosen is None or rules[chosen].kind not in _FAILING:
                self._streak[path] = 0
            else:
                self._streak[path] = streak + 1
            if chosen is None:
                return Decision(path=path, call_index=call, opens=opens)
            self._injected[chosen] += 1
            rule = rules[chosen]
            return Decision(
                path=path,
                call_index=call,
                kind=rule.kind,
                status=rule.answer_status,
                delay=rule.delay,
                rule_index=chosen,
                opens=opens if rule.kind in _AFTER_SENDING or rule.kind == "latency" else (),
            )

    def forwarded(self, decision: Decision) -> None:
        """Tell the decider ``decision``'s request is being handed to the engine: opens its windows."""
        if not decision.opens:
            return
        with self._lock:
            now = self._clock()
            for i in decision.opens:
                delay = self.plan.rules[i].delay
                assert delay is not None  # validated: windows have a delay
                self._window_until[i] = max(self._window_until.get(i, now), now + delay)
