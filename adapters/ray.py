"""Ray: SGLang and vLLM engines driven through Ray actors, and a ``FanOut`` over ObjectRefs.

Each engine gets one engine actor holding its client, built inside the actor (``SGLangEngineActor``: an ``SGLangClient``;
``VLLMEngineActor``: a ``VLLMEngine``); the driver side sees ``RayEngine`` / ``RayVLLMEngine`` handles, which the
``Orchestrator`` accepts like clients (a ``RayVLLMEngine`` carries vLLM's ``control_rules`` and ``tags``). Actors talk
to engines by URL only, and the package must be importable on every node, as for any Ray code. Use, mixed fleets and
engines that join: ``docs/barrier.md``, "Ray".

``RayFanOut`` submits a phase to every actor at once, waits for all the ObjectRefs with the phase deadline, and turns
Ray's errors into the ones the barrier understands: a dead actor is ``EngineDied`` naming the engine, an actor Ray
cannot reach for now is ``EngineUnavailable`` (both "may have run", as Ray documents: the barrier treats what the call
touches as unknown), an error raised inside the actor is the original error (``SGLangError``, ``AmbiguousOutcome``, a
``requests`` ``ConnectionError`` with ``.attempts``), and an actor that has not answered by the deadline is
``PhaseTimeout`` with a handle the barrier waits on before it sends that engine anything else. The phase deadline
travels with every call as seconds left (no clock is shared between machines) and caps every HTTP call made inside the
actor.

This is the only module of the package that imports ``ray``.
"""

from __future__ import annotations

import copyreg
import inspect
import pickle
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, overload

import ray
import ray.exceptions

from resilience.adapters.engine_state import ForwardedCalls
from resilience.adapters.routing import engine_of
from resilience.adapters.sglang import SGLangClient
from resilience.adapters.vllm.engine import VLLM_TAGS, VLLMEngine
from resilience.barrier.fanout import Calls, EngineResult, PhaseTimeout
from resilience.deadline import CURRENT_DEADLINE, Deadline
from resilience.engine_contract import VLLM_RULES, EngineDied, EngineUnavailable, engine_name

__all__ = [
    "DEFAULT_ACTOR_OPTIONS", "DEFAULT_READY_TIMEOUT_S", "ENGINE_KINDS", "EngineKind", "LateRef", "RayEngine", "RayFanOut",
    "RayEngineHandle", "RayVLLMEngine", "SGLangEngineActor", "TimedValue", "VLLMEngineActor", "ray_engine", "ray_engines",
]

EngineKind = Literal["sglang", "vllm"]
"""The engine kinds an engine actor can hold: ``"sglang"`` (an ``SGLangClient``) or ``"vllm"`` (a ``VLLMEngine``)."""

DEFAULT_ACTOR_OPTIONS: Mapping[str, Any] = {"num_cpus": 0, "max_concurrency": 4, "max_restarts": 0}
"""Options every engine actor is created with unless ``actor_options`` overrides them.

``num_cpus=0``: an actor only waits on HTTP, so it reserves no CPU and many fit on a small machine (Ray still starts one
worker process per actor). ``max_concurrency=4``: calls one actor runs at once, so a ``health()`` or a rollback is not
queued behind a control call still waiting on a slow engine. ``max_restarts=0``: a dead actor stays dead and is reported
as ``EngineDied``; a silently restarted actor would hold a fresh client that does not know what the engine had released.
"""

DEFAULT_READY_TIMEOUT_S = 120.0
"""Seconds ``ray_engines`` waits for every actor to start and build its client."""

_ACTOR_GONE = (ray.exceptions.RayActorError,)  # ActorDiedError and ActorUnavailableError are subclasses
_ACTOR_UNAVAILABLE = (ray.exceptions.ActorUnavailableError,)
_NOT_REMOTE = frozenset({"generate_stream", "close"})  # iterators do not cross processes; the actor owns its session


# -- errors that cross the process boundary ------------------------------------------------------


def _rebuild_exception(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """Rebuild an exception from its args and attributes without calling ``__init__``."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


def _reduce_exception(exc: BaseException) -> tuple[Callable[..., BaseException], tuple[Any, ...]]:
    return _rebuild_exception, (type(exc), exc.args, dict(vars(exc)))


def _round_trips(obj: object) -> bool:
    try:
        pickle.loads(pickle.dumps(obj))
    except Exception:
        return False
    return True


def _portable(exc: BaseException) -> BaseException:
    """Make ``exc`` survive pickling, so the driver sees the real error and not a stand-in.

    Runs inside the actor's own worker process. An exception class whose ``__init__`` cannot be called with its ``args``
    alone (keyword-only or extra required parameters) gets a reducer that restores args and attributes without
    ``__init__``; attributes that cannot be pickled (a response holding a socket) are replaced by their ``repr``.
    """
    if _round_trips(exc):
        return exc
    copyreg.pickle(type(exc), _reduce_exception)  # by exact type: this class only, in this actor's process only
    for key, value in list(vars(exc).items()):
        if isinstance(value, BaseException):
            value = _portable(value)
        exc.__dict__[key] = value if _round_trips(value) else repr(value)
    return exc


def _unwrap(error: BaseException, engine: str) -> BaseException:
    """The error the barrier should see for a Ray failure of ``engine``'s call.

    Ray's docs on ``ActorDiedError`` and ``ActorUnavailableError`` say the task may or may not have run; ``EngineDied``
    and ``EngineUnavailable`` keep that "maybe" (the barrier marks what the call touches unknown).
    """
    if isinstance(error, _ACTOR_UNAVAILABLE):
        gone = EngineUnavailable(f"{engine}: Ray cannot reach the actor holding this engine for now: {_first_line(error)}")
        gone.__cause__ = error
        return gone
    if isinstance(error, _ACTOR_GONE):
        died = EngineDied(f"{engine}: the Ray actor holding this engine is gone ({type(error).__name__}): {_first_line(error)}")
        died.__cause__ = error
        return died
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = getattr(error, "cause", None)
        if isinstance(cause, BaseException):
            return cause
        dual: Callable[[], BaseException] = getattr(error, "as_instanceof_cause")  # noqa: B009 (ray is untyped)
        try:
            return dual()
        except Exception:
            return error
    return error


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


# -- the actors ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TimedValue:
    """What an engine actor's ``timed_call`` returns: the call's value and how long it took inside the actor, seconds."""

    value: Any
    duration_s: float


class _EngineActor(ForwardedCalls):
    """The body shared by every engine actor: one client, built inside the actor, and its methods run by name."""

    target: type[Any]
    """The client class the actor holds (its public methods are what ``call`` may run)."""

    def __init__(self, base_url: str, client_kwargs: Mapping[str, Any] | None = None) -> None:
        self._client = self.target(base_url, **dict(client_kwargs or {}))

    def engine(self) -> str:
        """The engine's name (``scheme://host:port``); answers as soon as the actor is up."""
        name: str = self._client.engine
        return name

    def call(self, method: str, kwargs: Mapping[str, Any] | None = None, deadline_s: float | None = None) -> Any:
        """``client.<method>(**kwargs)`` inside ``with Deadline(deadline_s):`` (None = no phase deadline)."""
        fn = self._method(method)
        try:
            with Deadline(deadline_s):
                value = fn(**dict(kwargs or {}))
        except Exception as exc:
            raise _portable(exc) from None
        if inspect.isgenerator(value):
            raise TypeError(f"{self.target.__name__}.{method} returns an iterator, which cannot leave the actor")
        return value

    def timed_call(self, method: str, kwargs: Mapping[str, Any] | None = None, deadline_s: float | None = None) -> TimedValue:
        """``call`` plus the time it took inside the actor (what ``RayFanOut`` reports per engine)."""
        t0 = time.monotonic()
        value = self.call(method, kwargs, deadline_s)
        return TimedValue(value, time.monotonic() - t0)

    def _forward(self, method: str, kwargs: Mapping[str, Any]) -> Any:
        return self.call(method, kwargs)

    def _method(self, method: str) -> Callable[..., Any]:
        if method.startswith("_") or method in _NOT_REMOTE:
            raise AttributeError(f"{method!r} is not a control method an engine actor runs")
        fn = getattr(self._client, method, None)
        if not callable(fn):
            raise AttributeError(f"{self.target.__name__} has no method {method!r}")
        return fn  # type: ignore[no-any-return]


class _SGLangEngineActor(_EngineActor):
    """The body of ``SGLangEngineActor``: one ``SGLangClient`` and the calls the orchestrator makes on it."""

    target = SGLangClient


class _VLLMEngineActor(_EngineActor):
    """The body of ``VLLMEngineActor``: one ``VLLMEngine`` (``client_kwargs``: ``sleep_level`` and the ``VLLMClient``'s)."""

    target = VLLMEngine


SGLangEngineActor: Any = ray.remote(**DEFAULT_ACTOR_OPTIONS)(_SGLangEngineActor)
"""The Ray actor class: ``SGLangEngineActor.options(...).remote(base_url, client_kwargs)``.

Holds ``SGLangClient(base_url, **client_kwargs)`` built inside the actor, and exposes the barrier's five calls,
``engine``, and ``call(method, kwargs, deadline_s)`` / ``timed_call(...)`` for any other public client method
(``health``, ``model_info``, ...). Created with ``DEFAULT_ACTOR_OPTIONS``. Errors raised inside reach the driver as
``RayTaskError`` around the original error; ``RayFanOut`` and ``RayEngine`` unwrap them.
"""

VLLMEngineActor: Any = ray.remote(**DEFAULT_ACTOR_OPTIONS)(_VLLMEngineActor)
"""The Ray actor class of a vLLM engine: ``VLLMEngineActor.options(...).remote(base_url, client_kwargs)``.

``SGLangEngineActor`` over ``VLLMEngine(base_url, **client_kwargs)`` (``sleep_level`` and ``VLLMClient`` keywords:
``policies``, ``api_key``, ...); ``weight_info``, ``is_paused`` and ``complete`` go through ``call``.
"""


# -- the driver-side handles ----------------------------------------------------------------------


def _seconds_left() -> float | None:
    deadline = CURRENT_DEADLINE.get()
    return deadline.remaining() if deadline is not None and deadline.bounded else None


def _cancel(ref: Any) -> None:
    try:
        ray.cancel(ref)
    except Exception:  # best effort: a finished or already dead task cannot be cancelled
        pass


class _RayHandle(ForwardedCalls):
    """What both handles share: the actor, the engine's name and URL, ``call``, ``kill`` and forwarding by name."""

    target: type[Any]
    """The client class inside the actor (what ``__getattr__`` forwards public methods of)."""
    kind: EngineKind
    """The engine kind (``ENGINE_KINDS``)."""

    def __init__(self, actor: Any, engine: str, base_url: str | None = None) -> None:
        self.actor = actor
        self.engine = engine
        self.base_url = base_url or engine

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine!r})"

    def call(self, method: str, /, **kwargs: Any) -> Any:
        """Run ``<client>.<method>(**kwargs)`` in the actor and return its value."""
        seconds = _seconds_left()
        ref = self.actor.call.remote(method, kwargs, seconds)
        try:
            return ray.get(ref, timeout=seconds)
        except ray.exceptions.GetTimeoutError:
            _cancel(ref)
            raise PhaseTimeout(f"{self.engine}: no answer to {method} before the deadline") from None
        except (ray.exceptions.RayTaskError, *_ACTOR_GONE) as exc:
            raise _unwrap(exc, self.engine) from None

    def _forward(self, method: str, kwargs: Mapping[str, Any]) -> Any:
        return self.call(method, **kwargs)

    def kill(self) -> None:
        """Kill the actor (not the engine); later calls raise ``EngineDied``."""
        ray.kill(self.actor, no_restart=True)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or name in _NOT_REMOTE or not callable(getattr(self.target, name, None)):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        def forward(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(getattr(self.target, name)).bind(self, *args, **kwargs).arguments
            return self.call(name, **{key: value for key, value in bound.items() if key != "self"})

        forward.__name__ = name
        forward.__doc__ = getattr(self.target, name).__doc__
        return forward


class RayEngine(_RayHandle):
    """A driver-side handle of one SGLang engine actor; the ``Orchestrator`` takes it like an ``SGLangClient``.

    ``engine``: the engine's name, ``scheme://host:port``. ``actor``: the ``ActorHandle`` of its ``SGLangEngineActor``.
    ``base_url``: the URL the actor's client talks to. Every method runs the client method of the same name in the actor
    and waits for it: the Deadline in force in the caller's context (a phase's, or your own ``with Deadline(5):``)
    travels as seconds left and caps the call inside the actor and the wait here. Errors are the client's own (unwrapped
    from Ray's); a dead actor raises ``EngineDied`` and no answer before the deadline raises ``PhaseTimeout``. Other
    public ``SGLangClient`` methods (``begin_weight_update``, ``generate``, ...) are forwarded the same way.
    """

    target = SGLangClient
    kind: EngineKind = "sglang"


class RayVLLMEngine(_RayHandle):
    """A driver-side handle of one vLLM engine actor; the ``Orchestrator`` takes it like a ``VLLMEngine``.

    The same as ``RayEngine`` (``engine``, ``actor``, ``base_url``, deadlines, errors) over a ``VLLMEngineActor``;
    ``control_rules`` (``VLLM_RULES``) and ``tags`` (``VLLM_TAGS``) tell the barrier it is a vLLM engine. Other public
    ``VLLMEngine`` methods (``push_weights``, ...) are forwarded by name.
    """

    target = VLLMEngine
    kind: EngineKind = "vllm"
    control_rules: Final = VLLM_RULES
    tags: Final = VLLM_TAGS


RayEngineHandle = RayEngine | RayVLLMEngine
"""A driver-side handle of an engine actor, of either kind."""

ENGINE_KINDS: Final[Mapping[str, tuple[Any, type[RayEngine] | type[RayVLLMEngine]]]] = {
    "sglang": (SGLangEngineActor, RayEngine),
    "vllm": (VLLMEngineActor, RayVLLMEngine),
}
"""Engine kind -> (its actor class, its driver-side handle class)."""


def _kinds_of(kind: EngineKind | Sequence[EngineKind], n: int) -> list[EngineKind]:
    kinds: list[EngineKind] = [kind] * n if isinstance(kind, str) else list(kind)
    if len(kinds) != n:
        raise ValueError(f"ray_engines kind must be one kind or one per URL ({n}), but got {len(kinds)} kinds")
    for k in kinds:
        if k not in ENGINE_KINDS:
            raise ValueError(f"ray_engines kind must be one of {sorted(ENGINE_KINDS)}, but got {k!r}")
    return kinds


@overload
def ray_engines(
    base_urls: Sequence[str], *, kind: Literal["sglang"] = "sglang", client_kwargs: Mapping[str, Any] | None = None,
    actor_options: Mapping[str, Any] | None = None, ready_timeout_s: float | None = DEFAULT_READY_TIMEOUT_S
) -> list[RayEngine]: ...


@overload
def ray_engines(
    base_urls: Sequence[str], *, kind: Literal["vllm"], client_kwargs: Mapping[str, Any] | None = None,
    actor_options: Mapping[str, Any] | None = None, ready_timeout_s: float | None = DEFAULT_READY_TIMEOUT_S
) -> list[RayVLLMEngine]: ...


@overload
def ray_engines(
    base_urls: Sequence[str], *, kind: Sequence[EngineKind], client_kwargs: Mapping[str, Any] | None = None,
    actor_options: Mapping[str, Any] | None = None, ready_timeout_s: float | None = DEFAULT_READY_TIMEOUT_S
) -> list[RayEngineHandle]: ...


def ray_engines(
    base_urls: Sequence[str], *, kind: EngineKind | Sequence[EngineKind] = "sglang", client_kwargs: Mapping[str, Any] | None = None,
    actor_options: Mapping[str, Any] | None = None, ready_timeout_s: float | None = DEFAULT_READY_TIMEOUT_S
) -> list[RayEngine] | list[RayVLLMEngine] | list[RayEngineHandle]:
    """One engine actor per URL, as handles in the same order (``RayEngine`` for SGLang, ``RayVLLMEngine`` for vLLM).

    ``kind``: ``"sglang"`` (default) or ``"vllm"`` for every URL, or one kind per URL (a mixed fleet).
    ``client_kwargs``: keyword arguments of the client inside each actor (``SGLangClient``'s, or ``VLLMEngine``'s:
    ``sleep_level`` and ``VLLMClient``'s; ``policies``, ``api_key``, ...; default none; the same for every URL, so a
    mixed fleet takes only keywords both clients know, or one call per kind). They are pickled to the actors, so pass
    values, not sessions. ``actor_options``: Ray actor options merged over ``DEFAULT_ACTOR_OPTIONS`` (``num_cpus=0``,
    ``max_concurrency=4``, ``max_restarts=0``). ``ready_timeout_s``: wait this long for every actor to start and build
    its client (default 120 s; None = return at once and let the first call wait). On failure every actor created here
    is killed and the error names the engine.
    """
    for url in base_urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"ray_engines base_urls must start with http:// or https://, but got {url!r}")
    kinds = _kinds_of(kind, len(base_urls))
    names = [engine_of(url)[0] for url in base_urls]
    if len(set(names)) != len(names):
        raise ValueError(f"ray_engines base_urls must name distinct engines, but got {names}")
    options = {**DEFAULT_ACTOR_OPTIONS, **dict(actor_options or {})}
    kwargs = dict(client_kwargs or {})
    engines: list[RayEngineHandle] = []
    try:
        for url, name, k in zip(base_urls, names, kinds, strict=True):
            actor_class, handle_class = ENGINE_KINDS[k]
            actor = actor_class.options(**options).remote(url, kwargs)
            engines.append(handle_class(actor, name, url.rstrip("/")))
        if ready_timeout_s is not None:
            _wait_ready(engines, ready_timeout_s)
    except BaseException:
        for engine in engines:
            try:
                engine.kill()
            except Exception:  # already gone
                pass
        raise
    return engines


def ray_engine(
    base_url: str, *, kind: EngineKind = "sglang", client_kwargs: Mapping[str, Any] | None = None,
    actor_options: Mapping[str, Any] | None = None, ready_timeout_s: float | None = DEFAULT_READY_TIMEOUT_S
) -> RayEngineHandle:
    """One more engine actor, for an engine that joins a running fleet (or one whose actor was lost with its node).

    The same arguments as ``ray_engines`` for one URL; ``actor_options`` may
    place it (``{"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}``).
    """
    kinds: list[EngineKind] = [kind]
    return ray_engines([base_url], kind=kinds, client_kwargs=client_kwargs, actor_options=actor_options, ready_timeout_s=ready_timeout_s)[0]


def _wait_ready(engines: Sequence[RayEngineHandle], timeout_s: float) -> None:
    refs = [e.actor.engine.remote() for e in engines]
    _ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if not_ready:
        pending = set(not_ready)
        late = [e.engine for e, r in zip(engines, refs, strict=True) if r in pending]
        raise TimeoutError(f"{len(late)} engine actor(s) not started within {timeout_s} s: {', '.join(late[:8])}")
    for engine, ref in zip(engines, refs, strict=True):
        try:
            ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"{engine.engine}: the engine actor failed to start: {_first_line(exc)}") from exc


# -- the fan-out ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


class LateRef:
    """A ``LateCall`` over the ObjectRef of a call that missed its phase deadline (``EngineResult.late``)."""

    def __init__(self, ref: Any, engine: str) -> None:
        self.ref = ref
        self.engine = engine

    def wait(self, timeout: float | None) -> tuple[bool, BaseException | None]:
        """Wait up to ``timeout`` s; (landed, its error or None). A cancelled call counts as "may have run"."""
        ready, _ = ray.wait([self.ref], num_returns=1, timeout=timeout, fetch_local=True)
        if not ready:
            return False, None
        try:
            ray.get(self.ref)
        except ray.exceptions.TaskCancelledError as exc:  # cancelled while it may have been running: unknown
            return True, PhaseTimeout(f"{self.engine}: a late call was cancelled; it may have run ({_first_line(exc)})")
        except Exception as exc:
            return True, _unwrap(exc, self.engine)
        return True, None


def _get_all(refs: Sequence[Any]) -> dict[Any, Any]:
    """The value of every ready ref, or ``_Failed`` with its error: one ``ray.get`` when none failed, else one each."""
    if not refs:
        return {}
    try:
        return dict(zip(refs, ray.get(list(refs)), strict=True))
    except Exception:  # some ref failed: ray.get raised the first error; collect each one's own
        pass
    values: dict[Any, Any] = {}
    for ref in refs:
        try:
            values[ref] = ray.get(ref)
        except Exception as exc:
            values[ref] = _Failed(exc)
    return values


class RayFanOut:
    """A ``FanOut`` over Ray actors: every engine's call is an ObjectRef, all submitted before any is awaited.

    Engines are ``RayEngine`` / ``RayVLLMEngine`` handles (an ``actor`` that answers ``timed_call``), of one kind or
    mixed; errors as the module docstring says. A ref not ready by the deadline is cancelled (best effort: a call
    already running finishes on its own deadline), and its ``EngineResult.late`` lets the barrier wait for it to land.
    ``duration_s``: the call's own time inside the actor; for failures, until the driver saw it (or the deadline).
    ``cancel_late``: cancel refs that missed the deadline (default True).
    """

    def __init__(self, *, cancel_late: bool = True) -> None:
        self.cancel_late = cancel_late

    def check_engines(self, engines: Iterable[object]) -> None:
        """Refuse an engine without a Ray actor (``TypeError`` naming it); ``call`` checks every engine of a phase before it
        sends anything, and the ``Orchestrator`` checks them all when it is built."""
        for engine in engines:
            actor = getattr(engine, "actor", None)
            if actor is None or getattr(actor, "timed_call", None) is None:
                raise TypeError(f"RayFanOut needs engines with a Ray engine actor (see ray_engines), but {engine_name(engine)} has none")

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        """One result per (engine, kwargs) pair, in the order given."""
        if not calls:
            return []
        self.check_engines(engine for engine, _ in calls)  # every engine of the phase, before anything is sent
        seconds = deadline.remaining() if deadline.bounded else None
        names = [engine_name(engine) for engine, _ in calls]
        t0 = time.monotonic()
        actors: list[Any] = [getattr(engine, "actor", None) for engine, _ in calls]
        refs: list[Any] = [actor.timed_call.remote(method, dict(kw), seconds) for actor, (_, kw) in zip(actors, calls, strict=True)]
        _ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=seconds, fetch_local=True)
        waited = time.monotonic() - t0
        late = set(not_ready)
        values = _get_all([r for r in refs if r not in late])
        results: list[EngineResult] = []
        for name, ref in zip(names, refs, strict=True):
            if ref in late:
                if self.cancel_late:
                    _cancel(ref)
                timeout = PhaseTimeout(f"{name}: no answer to {method} before the phase deadline")
                results.append(EngineResult(name, error=timeout, duration_s=waited, late=LateRef(ref, name)))
                continue
            timed = values[ref]
            if isinstance(timed, _Failed):
                results.append(EngineResult(name, error=_unwrap(timed.error, name), duration_s=waited))
                continue
            if isinstance(timed, TimedValue):
                results.append(EngineResult(name, value=timed.value, duration_s=timed.duration_s))
            else:  # an actor of another class answering ``timed_call`` with a bare value
                results.append(EngineResult(name, value=timed, duration_s=waited))
        return results
