"""Verify after a transition: "a 200 that isn't healthy" (vLLM RFC #48310: "A 200 response proves only that an endpoint returned").

An onload or a weight sync that returned has done what its calls promised, yet an engine can still be wrong: back from a
level-2 sleep answering 200 with garbage (verl #7904, TRL #5312), or a weight push that landed on all engines but one.
``Orchestrator.onload(verify=...)`` and ``Orchestrator.weight_sync(verify=...)`` (and ``AsyncOrchestrator``'s) then ask
each engine the transition covered:

- ``WeightVersionCheck(expected)``: the weight version it reports equals the one pushed (vLLM ``GET /weight_info``,
  SGLang ``GET /model_info``'s ``weight_version``).
- ``CanaryCheck(prompt, expected)``: a greedy completion of ``prompt`` equals the reference the caller gives (vLLM
  ``/v1/completions``, SGLang ``/generate``).

The checks are reads, sent through the orchestrator's own fan-out: each (check, method) group to all its engines at
once, the groups one after another, all under one ``verify`` deadline (``PhaseDeadlines.continue_s``). They run after
the transition's own work: the engines stay where it put them. A check that needs a serving engine (the canary) is not
sent to engines the transition left held or not serving (a paused engine would hold or refuse it). Any mismatch, or a
read that failed, raises ``VerificationFailed`` (a ``PhaseFailed`` with phase ``"verify"``) naming each engine with a
``CheckFailed``; the transition's own report is on it as ``.report``.

A check is anything with the ``EngineCheck`` shape: which read to send to an engine (a method name and keyword
arguments), and what the answer means.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from resilience.barrier.fanout import Calls, EngineResult
from resilience.barrier.state import BarrierState, PhaseFailed, TransitionReport, short
from resilience.barrier.transitions import ReadStep, Steps
from resilience.deadline import Deadline
from resilience.engine_contract import AnyEngine, engine_name

__all__ = [
    "CanaryCheck", "CheckFailed", "EngineCheck", "VerificationFailed", "WeightVersionCheck", "check_steps", "checks_arg",
    "judge_one", "unreadable", "verify_steps",
]

Heard = Callable[[Sequence[EngineResult]], None]
"""Told every read's answers before they are judged (``BarrierState.heard``: the weight versions engines report)."""


@runtime_checkable
class EngineCheck(Protocol):
    """One verification: the read it sends to an engine and what the answer means.

    ``name``: for messages ("weight version"). ``needs_serving``: True when the read needs an engine that serves (a
    completion); it is then sent only to engines the transition left serving.
    """

    @property
    def name(self) -> str:
        """What the check verifies, for messages."""
        ...

    @property
    def needs_serving(self) -> bool:
        """True when its read needs a serving engine."""
        ...

    def request(self, engine: object) -> tuple[str, Mapping[str, Any]]:
        """The engine method to call and its keyword arguments; ``TypeError`` when this engine has no such read."""
        ...

    def judge(self, engine: str, value: object) -> CheckFailed | None:
        """None when ``value`` (what the read returned) is right for ``engine``, else the mismatch."""
        ...


class CheckFailed(RuntimeError):
    """One engine failed one check: ``engine``, ``check``, ``expected`` and ``got`` (what it reported; None when the read failed)."""

    def __init__(self, engine: str, check: str, expected: object, got: object, *, detail: str = "") -> None:
        self.engine = engine
        self.check = check
        self.expected = expected
        self.got = got
        super().__init__(detail or f"{check}: expected {expected!r}, the engine reports {got!r}")


class VerificationFailed(PhaseFailed):
    """A transition did its work, but engines failed the checks after it (phase ``"verify"``).

    ``failures`` (and ``by_engine``, typed so): each failing engine with its
    first ``CheckFailed``; ``mismatches``: every ``CheckFailed``, in check order; ``report``: the
    transition's own ``TransitionReport`` (what it did before the checks; for a weight sync, the end of its hold).
    """

    def __init__(
        self,
        transition: str,
        failures: Mapping[str, CheckFailed],
        mismatches: Sequence[CheckFailed],
        report: TransitionReport,
        **kwargs: Any,
    ) -> None:
        self.mismatches = tuple(mismatches)
        self.by_engine: dict[str, CheckFailed] = dict(failures)
        self.report = report
        super().__init__(transition, "verify", failures, **kwargs)


def _compare(check: str, expected: str | Mapping[str, str], engine: str, got: object, what: str) -> CheckFailed | None:
    """A mismatch when ``got`` is not what ``expected`` holds for ``engine`` (``what``: what was not given, if nothing was)."""
    want = expected if isinstance(expected, str) else expected.get(engine)
    if want is None:
        return CheckFailed(engine, check, None, None, detail=f"{check}: no {what} was given for this engine")
    return None if got == want else CheckFailed(engine, check, want, got)


def _check_expected(owner: str, values: object) -> None:
    if isinstance(values, str):
        if not values:
            raise ValueError(f"{owner} expected must be a non-empty string or a mapping of engine to string, but was ''")
    elif not (isinstance(values, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in values.items())):
        raise TypeError(f"{owner} expected must be a string or a mapping of engine name to string, but was {values!r}")


@dataclass(frozen=True, slots=True)
class WeightVersionCheck:
    """The weight version each engine reports equals ``expected`` (one string for all, or one per engine name).

    Read with ``weight_info()`` where the engine has it (vLLM ``GET /weight_info``, ``rl/online/api_router.py`` l.226),
    else ``model_info()`` (SGLang ``GET /model_info``): either answer's ``weight_version``.
    """

    expected: str | Mapping[str, str]
    name: str = "weight version"
    needs_serving: bool = False

    def __post_init__(self) -> None:
        _check_expected("WeightVersionCheck", self.expected)

    def request(self, engine: object) -> tuple[str, Mapping[str, Any]]:
        """``weight_info`` (vLLM) or ``model_info`` (SGLang), no arguments."""
        for method in ("weight_info", "model_info"):
            if callable(getattr(engine, method, None)):
                return method, {}
        raise TypeError(f"{engine!r} has neither weight_info() nor model_info(): its weight version cannot be read")

    def judge(self, engine: str, value: object) -> CheckFailed | None:
        """A mismatch when the reported ``weight_version`` is not the expected one."""
        return _compare(self.name, self.expected, engine, getattr(value, "weight_version", None), "expected version")


@dataclass(frozen=True, slots=True)
class CanaryCheck:
    """A greedy completion of ``prompt`` equals ``expected`` (one reference for all, or one per engine name).

    ``max_tokens``: the completion's length (default 16; give the reference's). Sent as ``complete(prompt, max_tokens=,
    temperature=0.0)`` where the engine has it (``VLLMClient``), else ``generate(text, sampling_params=...)``
    (``SGLangClient``); either answer's ``text`` is compared, exactly. ``sampling``: more sampling parameters for both
    (default none).
    """

    prompt: str
    expected: str | Mapping[str, str]
    max_tokens: int = 16
    sampling: Mapping[str, Any] = field(default_factory=dict)
    name: str = "canary completion"
    needs_serving: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt:
            raise ValueError(f"CanaryCheck prompt must be a non-empty string, but was {self.prompt!r}")
        if isinstance(self.expected, str):
            pass  # an empty reference is a real answer (a completion that stopped at once)
        else:
            _check_expected("CanaryCheck", self.expected)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"CanaryCheck max_tokens must be an int >= 1, but was {self.max_tokens!r}")

    def request(self, engine: object) -> tuple[str, Mapping[str, Any]]:
        """``complete`` (vLLM) or ``generate`` (SGLang), greedy."""
        if callable(getattr(engine, "complete", None)):
            return "complete", {
                "prompt": self.prompt,
                "max_tokens": self.max_tokens,
                "temperature": 0.0,
                "extra": dict(self.sampling) or None,
            }
        if callable(getattr(engine, "generate", None)):
            params = {"max_new_tokens": self.max_tokens, "temperature": 0.0, **self.sampling}
            return "generate", {"text": self.prompt, "sampling_params": params}
        raise TypeError(f"{engine!r} has neither complete() nor generate(): no canary can be sent to it")

    def judge(self, engine: str, value: object) -> CheckFailed | None:
        """A mismatch when the completion's ``text`` is not the reference."""
        return _compare(self.name, self.expected, engine, getattr(value, "text", None), "reference")


@dataclass(frozen=True, slots=True)
class _Read:
    """One check's read of one group of engines that take the same method."""

    check: EngineCheck
    method: str
    calls: Calls


def _plan(
    checks: Sequence[EngineCheck], engines: Mapping[str, AnyEngine], not_serving: Mapping[str, str]
) -> tuple[list[_Read], list[CheckFailed]]:
    """The reads to send (one per check and method; a check that needs serving skips ``not_serving``) and the engines a
    check cannot read at all."""
    reads: list[_Read] = []
    failed: list[CheckFailed] = []
    for check in checks:
        groups: dict[str, list[tuple[AnyEngine, Mapping[str, Any]]]] = {}
        for name, engine in engines.items():
            if check.needs_serving and name in not_serving:
                continue
            try:
                method, kwargs = check.request(engine)
            except TypeError as exc:
                failed.append(unreadable(name, check, exc))
                continue
            groups.setdefault(method, []).append((engine, kwargs))
        reads.extend(_Read(check, method, calls) for method, calls in groups.items())
    return reads, failed


def unreadable(name: str, check: EngineCheck, why: object) -> CheckFailed:
    """``check`` cannot read engine ``name`` at all (``why``: the ``TypeError`` of its ``request``)."""
    return CheckFailed(name, check.name, None, None, detail=f"{check.name}: {why}")


def judge_one(check: EngineCheck, method: str, result: EngineResult) -> CheckFailed | None:
    """What one engine's answer to ``check``'s read (``method``) means: None when it is right, else the mismatch, or the
    read's failure (with its error as the cause)."""
    err = result.error
    if err is None:
        return check.judge(result.engine, result.value)
    detail = f"{check.name}: could not read it ({method}): {type(err).__name__}: {short(err)}"
    miss = CheckFailed(result.engine, check.name, None, None, detail=detail)
    miss.__cause__ = err
    return miss


def _judge(read: _Read, results: Sequence[EngineResult], heard: Heard | None) -> list[CheckFailed]:
    if heard is not None:
        heard(results)
    return [miss for result in results if (miss := judge_one(read.check, read.method, result)) is not None]


def _verdict(transition: str, report: TransitionReport, mismatches: list[CheckFailed], not_serving: Mapping[str, str]) -> TransitionReport:
    if not mismatches:
        return report
    first: dict[str, CheckFailed] = {}
    for miss in mismatches:
        first.setdefault(miss.engine, miss)
    raise VerificationFailed(transition, first, mismatches, report, left_paused=not_serving)


def checks_arg(checks: EngineCheck | Sequence[EngineCheck]) -> Sequence[EngineCheck]:
    """``checks`` as a tuple of ``EngineCheck`` (one given bare too); anything else is refused with a ``TypeError``."""
    if isinstance(checks, EngineCheck):  # one check given bare
        return (checks,)
    for check in checks:
        if not isinstance(check, EngineCheck):
            raise TypeError(f"verify takes EngineCheck objects (WeightVersionCheck, CanaryCheck), but got {check!r}")
    return tuple(checks)


def check_steps(
    transition: str,
    report: TransitionReport,
    checks: EngineCheck | Sequence[EngineCheck],
    engines: Mapping[str, AnyEngine],
    *,
    not_serving: Mapping[str, str],
    deadline_s: float,
    heard: Heard | None = None,
) -> Generator[ReadStep[Any], None, TransitionReport]:
    """Run ``checks`` on ``engines``, one ``ReadStep`` per check and method; ``report`` when all pass, else ``VerificationFailed``.

    ``not_serving``: the orchestrator's engines that do not serve, with why (checks that need serving skip them; when
    another check fails, the error names them too). ``deadline_s``: for all reads together. ``heard``: told each read's
    answers (default None: nobody). A read the fan-out could not send raises its error.
    """
    reads, mismatches = _plan(checks_arg(checks), engines, not_serving)
    deadline = Deadline(deadline_s)
    for read in reads:
        step: ReadStep[Any] = ReadStep(read.method, tuple((engine_name(e), kw) for e, kw in read.calls), list(read.calls), deadline)
        yield step
        if step.error is not None:
            raise step.error
        mismatches.extend(_judge(read, step.results or (), heard))
    return _verdict(transition, report, mismatches, not_serving)


def verify_steps(
    state: BarrierState[Any], transition: str, report: TransitionReport, checks: EngineCheck | Sequence[EngineCheck], names: Iterable[str]
) -> Steps[TransitionReport]:
    """``report`` once ``checks`` passed on the engines ``names`` (not retired), under the verify limit: what both
    orchestrators drive after an onload or a weight sync."""
    if not checks:
        return report
    engines = {n: state.engines[n] for n in state.active(names)}
    not_serving, limit = state.not_serving(), state.deadlines.for_phase("verify")
    return (yield from check_steps(transition, report, checks, engines, not_serving=not_serving, deadline_s=limit, heard=state.heard))
