"""Real RL frameworks' own client code, unmodified, driving emulated engines behind ``FaultProxy``.

The rig of ``tests/frameworks`` and ``benchmarks/bench_frameworks.py``; each framework runs its trainer's own cycle:

- **AReaL 1.0.4** ``RemoteSGLangEngine``: ``PPOTrainer._offload_rollout`` then ``_onload_rollout``
  (``areal/trainer/rl_trainer.py``: ``pause_generation()``, ``offload()``; ``onload()`` and, whatever it raised,
  ``continue_generation()``), each call fanned out by ``arequest_with_retry`` (``areal/infra/utils/http.py``:
  ``request_retries`` = 3 tries, 1 s apart, on any error).
- **verl 0.9.1** ``AsyncHttpServerAdapter`` (``verl/workers/rollout/sglang_rollout/http_server_engine.py``, loaded
  by path, ``sglang`` stubbed: ``load_verl_http_engine``), one per engine, sending what ``ServerAdapter.release`` /
  ``resume`` / ``update_weights`` send (``sglang_rollout.py``): release ``["kv_cache", "weights"]``, resume
  ``["weights"]``, ``flush_cache()``, resume ``["kv_cache"]``, every engine at once. verl retries timeouts and
  refusals 3 times (2 s, 4 s), a status never.
- **SkyRL 0.4.0** on vLLM engines (``resilience.testing.skyrl``).

Mounts (``MOUNTS``): ``shipped`` (nothing of ours), ``SGLangInstrumentor`` over ``SGLANG_POLICIES``
(``middleware``), over ``sglang_policies(memory_probe=...)`` (``probe``), over ``SGLANG_STRICT_POLICIES``
(``strict``); our backoffs shortened by ``fast_policies``. Plans (``PLANS``): ``transient``, 502s before
forwarding (``rate`` 0.4 on the control calls); ``after``, plus 502s after forwarding on release and resume
(``after`` 0.3). Each is capped at ``MAX_STREAK`` failures in a row per path, or not (``max_streak=None``).

A cycle **completes** when it returned and every engine is alive, serving, with nothing released; after one that
did not, the engines are put back (dead ones restarted) as a restarted job would find them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.emulator.vllm import VLLMEngineConfig
from resilience.testing.faultplan import FaultPlan, FaultRule
from resilience.testing.stubbed_import import framework_file, load_stubbed, never_called

__all__ = [
    "FRAMEWORKS",
    "MOUNTS",
    "PLANS",
    "RIG_ENGINE_CONFIG",
    "CycleResult",
    "FrameworkMissing",
    "SeedResult",
    "fault_plan",
    "load_verl_http_engine",
    "run_seed",
]

FRAMEWORKS: tuple[str, ...] = ("areal", "verl", "skyrl")
ENGINE_KIND: dict[str, str] = {"areal": "sglang", "verl": "sglang", "skyrl": "vllm"}
"""Which engine each framework's driven client talks to."""
MOUNTS: tuple[str, ...] = ("shipped", "middleware", "probe", "strict")
PLANS: tuple[str, ...] = ("transient", "after")
RIG_ENGINE_CONFIG = EngineConfig(
    token_rate=400.0, health_hang_seconds=1.0, health_poll_seconds=0.05, abort_poll_seconds=0.05, swap_seconds=0.01
)
"""Quick swaps and short health hangs: the rig measures decisions, not waits."""
RIG_VLLM_CONFIG = VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, token_rate=400.0)
"""vLLM 0.33.0 engines as SkyRL runs them: dev mode (its control routes) and sleep mode (slept memory really gone)."""
_VLLM_SWAP_PATHS = ("/sleep", "/wake_up")
_VLLM_TRANSIENT_PATHS = ("/is_sleeping", *_VLLM_SWAP_PATHS)
VERL_VERSION = "0.9.1"
AREAL_VERSION = "1.0.4"
_SWAP_PATHS = ("/release_memory_occupation", "/resume_memory_occupation")
_TRANSIENT_PATHS = ("/pause_generation", "/continue_generation", "/flush_cache", *_SWAP_PATHS)
_HTTP_TIMEOUT = 10.0
MAX_STREAK = 5
"""The capped plans' most failures in a row per path (one less than the presets' 6 attempts)."""


class FrameworkMissing(RuntimeError):
    """The framework's package (or wheel) is not installed here; the message says how to install it."""


def fault_plan(
    plan: str, seed: int, *, rate: float = 0.4, after: float = 0.3, max_streak: int | None = MAX_STREAK, engine: str = "sglang"
) -> FaultPlan:
    """The rig's plans: ``transient`` and ``after`` (see the module docstring); ``rate`` and ``after`` are the two probabilities,
    ``max_streak`` the most failures in a row per path (default ``MAX_STREAK``, 5; None: no cap). ``engine``: ``"sglang"``
    (pause, continue, flush, release, resume; after forwarding on release and resume) or ``"vllm"`` (``/is_sleeping``,
    ``/sleep``, ``/wake_up``; after forwarding on sleep and wake)."""
    if plan not in PLANS:
        raise ValueError(f"`plan` must be one of {PLANS}, but was {plan!r}")
    if engine not in ("sglang", "vllm"):
        raise ValueError(f"`engine` must be 'sglang' or 'vllm', but was {engine!r}")
    swaps, transient = (_SWAP_PATHS, _TRANSIENT_PATHS) if engine == "sglang" else (_VLLM_SWAP_PATHS, _VLLM_TRANSIENT_PATHS)
    rules: list[FaultRule] = []
    if plan == "after":
        rules += [FaultRule(p, "status_after", probability=after) for p in swaps]
    rules += [FaultRule(p, "status_before", probability=rate) for p in transient]
    return FaultPlan(seed=seed, rules=tuple(rules), max_streak=max_streak)


# -- verl: http_server_engine.py by path, sglang stubbed --------------------------------


def _verl_source() -> Path:
    missing = FrameworkMissing(
        f"verl {VERL_VERSION}'s http_server_engine.py is not here: run scripts/setup.sh (it unpacks "
        f"`pip download --no-deps verl=={VERL_VERSION}` into ~/.cache/cpr/verl), or set CPR_VERL_SOURCE"
    )
    return framework_file("verl", "verl/workers/rollout/sglang_rollout/http_server_engine.py", "CPR_VERL_SOURCE", missing)


class _ServerArgs:
    """Stands for ``sglang.srt.server_args.ServerArgs``: the control path reads ``host``, ``port`` and ``node_rank`` only."""

    def __init__(self, host: str = "127.0.0.1", port: int = 30000, node_rank: int = 0, **kwargs: Any) -> None:
        self.host, self.port, self.node_rank = host, port, node_rank
        self.extra = kwargs


def load_verl_http_engine() -> types.ModuleType:
    """verl's ``http_server_engine`` module, loaded by path, with the ``sglang`` names it imports stubbed in its own
    namespace only (``EngineBase``, ``launch_server`` and ``kill_process_tree`` never called with
    ``launch_server=False``, ``UpdateWeightsFromTensorReqInput``, ``ServerArgs``); the control path is verl's code."""
    name = "cpr_verl_http_server_engine"
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    path = _verl_source()
    names = ["sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.EngineBase", "sglang.srt.entrypoints.http_server"]
    names += ["sglang.srt.managers", "sglang.srt.managers.io_struct", "sglang.srt.server_args", "sglang.srt.utils"]
    stubs = {n: types.ModuleType(n) for n in names}
    stubs["sglang.srt.entrypoints.EngineBase"].EngineBase = type("EngineBase", (), {})  # type: ignore[attr-defined]
    stubs["sglang.srt.entrypoints.http_server"].launch_server = never_called("sglang", "launch_server")  # type: ignore[attr-defined]
    stubs["sglang.srt.managers.io_struct"].UpdateWeightsFromTensorReqInput = type("UpdateWeightsFromTensorReqInput", (), {})  # type: ignore[attr-defined]
    stubs["sglang.srt.server_args"].ServerArgs = _ServerArgs  # type: ignore[attr-defined]
    stubs["sglang.srt.utils"].kill_process_tree = never_called("sglang", "kill_process_tree")  # type: ignore[attr-defined]
    return load_stubbed(name, path, stubs)


# -- the two frameworks' cycles ---------------------------------------------------------


@contextlib.contextmanager
def _keeping_logging() -> Iterator[None]:
    """Put the process's logging back after the block: AReaL's ``getLogger`` replaces ``logging.Logger.root`` and
    ``.manager`` and runs ``dictConfig(disable_existing_loggers=...)``, which would cut later loggers off the root."""
    root, manager = logging.Logger.root, logging.Logger.manager
    loggers = [lg for lg in manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    before = [(lg, lg.level, lg.propagate, lg.disabled, lg.parent, list(lg.handlers)) for lg in [root, *loggers]]
    try:
        yield
    finally:
        logging.Logger.root, logging.Logger.manager = root, manager
        for lg, level, propagate, disabled, parent, handlers in before:
            lg.level, lg.propagate, lg.disabled, lg.parent, lg.handlers = level, propagate, disabled, parent, handlers


def _areal_engine(urls: Sequence[str]) -> Any:
    with _keeping_logging():
        try:
            cli_args: Any = importlib.import_module("areal.api.cli_args")  # untyped: read as Any
            remote: Any = importlib.import_module("areal.engine.sglang_remote")
        except ImportError as exc:
            raise FrameworkMissing(f"AReaL {AREAL_VERSION} is not importable ({exc}): run scripts/setup.sh") from exc
        config = cli_args.InferenceEngineConfig(
            backend=f"sglang:d{len(urls)}", request_retries=3, request_timeout=3600, pause_grace_period=0.0
        )
        engine = remote.RemoteSGLangEngine(config)
    engine._engine.addresses = [u.split("://", 1)[1] for u in urls]  # what initialize(addr=...) sets, without its rollout workers
    return engine


def areal_cycle(engine: Any) -> None:
    """``PPOTrainer._offload_rollout`` then ``_onload_rollout``'s HTTP calls (``areal/trainer/rl_trainer.py``)."""
    with _keeping_logging():
        _areal_cycle(engine)


def _areal_cycle(engine: Any) -> None:
    engine.pause_generation()
    engine.offload()
    error: BaseException | None = None
    try:
        engine.onload()
    except Exception as exc:
        error = exc
    try:
        engine.continue_generation()
    except Exception as exc:
        error = error or exc
    if error is not None:
        raise error


def _verl_adapters(urls: Sequence[str], retry_delay: float) -> list[Any]:
    module = load_verl_http_engine()
    adapters = []
    for url in urls:
        host, port = url.split("://", 1)[1].rsplit(":", 1)
        adapters.append(module.AsyncHttpServerAdapter(host=host, port=int(port), launch_server=False, retry_delay=retry_delay))
    return adapters


def verl_cycle(adapters: Sequence[Any]) -> None:
    """``ServerAdapter.release``, ``resume(["weights"])``, ``update_weights``' flush, ``resume(["kv_cache"])`` on every engine at once."""

    async def each(step: Callable[[Any], Any]) -> None:
        results = await asyncio.gather(*(step(a) for a in adapters), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def cycle() -> None:
        await each(lambda a: a.release_memory_occupation(tags=["kv_cache", "weights"]))
        await each(lambda a: a.resume_memory_occupation(tags=["weights"]))
        await each(lambda a: a.flush_cache())
        await each(lambda a: a.resume_memory_occupation(tags=["kv_cache"]))

    asyncio.run(cycle())


# -- mounts -----------------------------------------------------------------------------


@contextmanager
def mounted(mount: str, fleet: EmulatedFleet, *, engine: str = "sglang") -> Iterator[Any]:
    """Our mount for ``mount`` (``MOUNTS``) over the fleet's proxy URLs, undone on exit; yields the instrumentor or None.

    ``engine="vllm"``: ``VLLMInstrumentor`` over ``VLLM_POLICIES`` (``middleware`` only)."""
    if mount not in MOUNTS:
        raise ValueError(f"`mount` must be one of {MOUNTS}, but was {mount!r}")
    if mount == "shipped":
        yield None
        return
    from resilience.adapters.instrument import SGLangInstrumentor, VLLMInstrumentor
    from resilience.adapters.sglang import policies as presets
    from resilience.testing.policies import fast_policies

    if engine == "vllm":
        if mount != "middleware":
            raise ValueError(f"`mount` {mount!r} has no vLLM form: vLLM's sleep and wake are idempotent (nothing for a probe to settle)")
        from resilience.adapters.vllm import VLLM_POLICIES

        vllm = VLLMInstrumentor(fleet.urls, policies=fast_policies(VLLM_POLICIES)).instrument()
        try:
            yield vllm
        finally:
            vllm.uninstrument()
        return

    table = fast_policies(presets.SGLANG_STRICT_POLICIES if mount == "strict" else presets.SGLANG_POLICIES)
    if mount == "probe":
        table = presets.with_memory_probe(table, fleet.memory_probe())
    inst = SGLangInstrumentor(fleet.urls, policies=table).instrument()
    try:
        yield inst
    finally:
        inst.uninstrument()


# -- one seed ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CycleResult:
    """One cycle: did it complete, what the framework raised, which engines died in it."""

    completed: bool
    error: str | None
    died: tuple[int, ...]


@dataclass(slots=True)
class SeedResult:
    """One seed's cycles on a fresh fleet."""

    framework: str
    plan: str
    mount: str
    seed: int
    cycles: list[CycleResult] = field(default_factory=list)
    sends: dict[str, int] = field(default_factory=dict)
    """Requests the proxies saw per path (every engine, every cycle)."""
    most_releases: int = 0
    """The most ``/release_memory_occupation`` requests one engine got in one cycle."""

    @property
    def completed(self) -> int:
        return sum(c.completed for c in self.cycles)

    @property
    def deaths(self) -> int:
        return sum(len(c.died) for c in self.cycles)


def _state(engine: Any) -> dict[str, Any] | None:
    """The engine's state over its direct URL, or None when it is dead (a crash can land just after the cycle)."""
    if engine.alive():
        try:
            state: dict[str, Any] = engine.state()
            return state
        except requests.RequestException:
            pass
    engine.wait_exit(2.0)
    return None


def _settled(states: Sequence[dict[str, Any] | None]) -> bool:
    """Every engine alive, serving (not paused) and with nothing released (SGLang) or asleep (vLLM)."""
    return all(
        s is not None
        and not s.get("paused")
        and not s.get("released_tags")
        and s.get("pause_state", "unpaused") == "unpaused"
        and not s.get("sleeping_tags")
        for s in states
    )


def _put_back(fleet: EmulatedFleet) -> None:
    """Dead engines restarted; live ones resumed and continued over their direct URLs (bypassing the proxies)."""
    for engine in fleet.engines:
        state = _state(engine)
        if state is None:
            engine.restart()
            continue
        if state.get("sleeping_tags"):
            requests.post(engine.direct_url + "/wake_up", timeout=_HTTP_TIMEOUT)
        if state.get("pause_state", "unpaused") != "unpaused":
            requests.post(engine.direct_url + "/resume", timeout=_HTTP_TIMEOUT)
        released = state.get("released_tags") or []
        if released:
            requests.post(engine.direct_url + "/resume_memory_occupation", json={"tags": list(released)}, timeout=_HTTP_TIMEOUT)
        if state.get("paused") or released:
            requests.post(engine.direct_url + "/continue_generation", json={}, timeout=_HTTP_TIMEOUT)


def run_seed(
    framework: str,
    plan: str,
    mount: str,
    seed: int,
    *,
    cycles: int = 5,
    engines: int = 3,
    max_streak: int | None = MAX_STREAK,
) -> SeedResult:
    """``cycles`` of ``framework``'s own cycle on a fresh fleet of ``engines`` behind proxies playing ``plan`` with ``seed``
    (``max_streak``: the plan's cap on failures in a row, default ``MAX_STREAK``; None: no cap)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"`framework` must be one of {FRAMEWORKS}, but was {framework!r}")
    result = SeedResult(framework, plan, mount, seed)
    kind = ENGINE_KIND[framework]
    faults = fault_plan(plan, seed, max_streak=max_streak, engine=kind)
    config = RIG_ENGINE_CONFIG if kind == "sglang" else RIG_VLLM_CONFIG
    swap_path = _SWAP_PATHS[0] if kind == "sglang" else _VLLM_SWAP_PATHS[0]
    with EmulatedFleet(engines, config, fault_plan=faults) as fleet, ExitStack() as mounts:
        mounts.enter_context(mounted(mount, fleet, engine=kind))
        client: Any
        cycle: Callable[[Any], None]
        if framework == "areal":
            client, cycle = _areal_engine(fleet.urls), areal_cycle
        elif framework == "verl":
            client, cycle = _verl_adapters(fleet.urls, retry_delay=0.2), verl_cycle
        else:
            from resilience.testing.skyrl import skyrl_client, skyrl_cycle

            client, cycle = skyrl_client(fleet.urls), skyrl_cycle
        releases = [0] * engines
        for _ in range(cycles):
            alive_before = {e.index for e in fleet.engines if e.alive()}
            error: str | None = None
            try:
                cycle(client)
            except Exception as exc:
                error = f"{type(exc).__name__}: {str(exc)[:200]}"
            for engine in fleet.engines:
                if engine.proxy is not None:
                    engine.proxy.settle(timeout=5.0)
            for engine in fleet.engines:
                if engine.proxy is not None:
                    now = sum(1 for r in engine.proxy.seen if r.path == swap_path)
                    result.most_releases = max(result.most_releases, now - releases[engine.index])
                    releases[engine.index] = now
            states = [_state(e) for e in fleet.engines]
            died = tuple(e.index for e, st in zip(fleet.engines, states, strict=True) if e.index in alive_before and st is None)
            ok = error is None and _settled(states)
            result.cycles.append(CycleResult(ok, error, died))
            if not ok:  # a restarted job: engines put back, a fresh process's mount (no breaker or ledger carried over)
                _put_back(fleet)
                mounts.close()
                mounts.enter_context(mounted(mount, fleet, engine=kind))
        for engine in fleet.engines:
            if engine.proxy is not None:
                for seen in engine.proxy.seen:
                    result.sends[seen.path] = result.sends.get(seen.path, 0) + 1
    return result
