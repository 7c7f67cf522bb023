"""The machinery ``cpr demo`` and ``cpr soak`` share: one emulated fleet, fresh fault proxies per run, telemetry.

:class:`FleetRunner` starts the engines once (each imports torch: the slow
part) and runs the colocate loop on them as many times as asked. Each run gets
fresh fault proxies in front of the same engines, so its call counters start at
zero and the same seed gives the same faults whichever run came first. Engines
that died are restarted by the loop's own recovery, so the fleet is in order
again when a run ends. Everything started here is stopped by PID on exit.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from resilience.barrier.journal import RestartBudget
from resilience.cli.common import CliError, need
from resilience.events import Observer
from resilience.testing.colocate import ColocateConfig, EngineKind, StepProgress, run_colocate
from resilience.testing.emulator import EmulatedFleet, EmulatorStartError, EngineConfig
from resilience.testing.emulator.vllm import VLLMEngineConfig
from resilience.testing.faults import FaultPlan, FaultProxy, FaultRule
from resilience.testing.lab import ColocateReport, LoopKind

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = [
    "CONTROLLER_RESTART",
    "DEMO_AMBIGUOUS",
    "DEMO_ENGINE",
    "ENGINE_FDS",
    "ENGINE_MEMORY_MIB",
    "VLLM_DEMO_ENGINE",
    "SOAK_STATUS_AFTER",
    "FleetRun",
    "EnginesBound",
    "FleetRunner",
    "Telemetry",
    "check_engines",
    "demo_plan",
    "engines_bound",
    "soak_plan",
    "vllm_demo_plan",
    "metric_totals",
    "start_telemetry",
]

PROXY_RECORDS = 200
"""Requests (and faults) each fault proxy of a cpr run keeps: enough for the timeline, bounded for soak memory."""

DEMO_ENGINE = EngineConfig(token_rate=400.0, health_hang_seconds=1.0, health_poll_seconds=0.05, abort_poll_seconds=0.05)
"""Engines time-scaled like the demo policies: fast decoding and 50 ms polls (SGLang polls every second)."""

CONTROLLER_RESTART = ColocateConfig(
    steps=1, seed=0, rollout_requests=1, stragglers=0, max_new_tokens=4, train_s=0.05, restart_limit=0, baseline_flush_polls=100,
    controller_crash_step=0,
)  # fmt: skip
"""The demo's controller-restart scenario: one step whose controller dies while the engines train (the baseline's
flush polled up to 5 s: engines its run just restarted may still be warming up on a loaded machine)."""

DEMO_AMBIGUOUS = 0.02
"""Chance that a release, resume or continue of ``cpr demo``/``cpr soak`` is cut after the engine acted
(reset once sent; a quarter as often, never answered): ``FaultPlan.seed_like(seed, ambiguous=...)``."""


def _first(base: FaultPlan, *rules: FaultRule) -> FaultPlan:
    """``base`` with ``rules`` tried before its own."""
    return FaultPlan(seed=base.seed, rules=(*rules, *base.rules), max_streak=base.max_streak)


def demo_plan(seed: int) -> FaultPlan:
    """The plan ``cpr demo`` and ``cpr soak`` play by default: ``FaultPlan.seed_like(seed, ambiguous=DEMO_AMBIGUOUS)``,
    and every engine's first release reset once sent, so every run meets the ambiguous case at its first offload."""
    return _first(FaultPlan.seed_like(seed, ambiguous=DEMO_AMBIGUOUS), FaultRule("/release_memory_occupation", "drop_after", calls={1}))


VLLM_DEMO_ENGINE = VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, weight_transfer_backend="nccl", token_rate=400.0)
"""The demo's and the soak's vLLM engines: dev mode (the control routes), sleep mode (slept memory is gone), NCCL weight transfer."""


def vllm_demo_plan(seed: int) -> FaultPlan:
    """``FaultPlan.vllm_like(seed, ambiguous=DEMO_AMBIGUOUS)``, and every engine's first ``/sleep`` reset once sent."""
    return _first(FaultPlan.vllm_like(seed, ambiguous=DEMO_AMBIGUOUS), FaultRule("/sleep", "drop_after", calls=frozenset({1})))


SOAK_STATUS_AFTER = 0.02
"""Chance that a release, resume or continue of ``cpr soak`` is answered 502 after the engine applied it (504 half as
often): ``FaultPlan.seed_like(seed, ambiguous=DEMO_AMBIGUOUS, status_after=...)``."""


def soak_plan(seed: int) -> FaultPlan:
    """The plan ``cpr soak`` plays by default: ``FaultPlan.seed_like(seed, ambiguous=DEMO_AMBIGUOUS,
    status_after=SOAK_STATUS_AFTER)``, every engine's first release reset once sent, its first resume answered 502
    and its first continue 504 after the engine acted, so a run of a few steps meets each case."""
    return _first(
        FaultPlan.seed_like(seed, ambiguous=DEMO_AMBIGUOUS, status_after=SOAK_STATUS_AFTER),
        FaultRule("/release_memory_occupation", "drop_after", calls={1}),
        FaultRule("/resume_memory_occupation", "status_after", status=502, calls={1}),
        FaultRule("/continue_generation", "status_after", status=504, calls={1}),
    )


ENGINE_MEMORY_MIB = 24
"""Memory one emulated engine of a cpr run costs, MiB: its PSS after one use (BENCHMARKS.md, "Emulated fleet": 4600 MiB
for 256 engines, 18 MiB each) plus its share of this process (its proxy, clients, threads), rounded up."""
ENGINE_FDS = 32
"""File descriptors one engine of a cpr run holds open in this process: its proxy's listener, the connections of its
rollout, stragglers and control calls on both sides of the proxy, its pipes (about 14 measured at 4 engines), doubled."""
_RESERVED_FDS = 64
"""Descriptors kept for everything else (the interpreter, /metrics, the report, the emulator's zygote)."""


@dataclass(frozen=True)
class EnginesBound:
    """How many emulated engines this machine holds for a cpr run, and what bounds it."""

    engines: int
    """The smaller of the two bounds below."""
    by_memory: int
    """``MemAvailable`` (``/proc/meminfo``) over ``ENGINE_MEMORY_MIB``; a large number where it cannot be read."""
    by_fds: int
    """This process's soft ``RLIMIT_NOFILE``, less ``_RESERVED_FDS``, over ``ENGINE_FDS``."""
    memory_mib: int | None
    fd_limit: int | None
    """The soft descriptor limit (None: unlimited)."""


def _available_mib() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def engines_bound() -> EnginesBound:
    """The engines this machine holds now: available memory and this process's file-descriptor limit."""
    import resource

    unbounded = 1 << 20
    memory = _available_mib()
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fds = None if soft == resource.RLIM_INFINITY else int(soft)
    by_memory = unbounded if memory is None else memory // ENGINE_MEMORY_MIB
    by_fds = unbounded if fds is None else max(0, fds - _RESERVED_FDS) // ENGINE_FDS
    return EnginesBound(min(by_memory, by_fds), by_memory, by_fds, memory, fds)


def check_engines(engines: int, flag: str) -> None:
    """Refuse (a :class:`CliError`, exit status 2) more engines than :func:`engines_bound` allows, naming the bound."""
    bound = engines_bound()
    if engines <= bound.engines:
        return
    reasons = []
    if bound.by_memory < engines:
        reasons.append(f"memory: {bound.memory_mib} MiB available / {ENGINE_MEMORY_MIB} MiB per engine = {bound.by_memory}")
    if bound.by_fds < engines:
        reasons.append(
            f"file descriptors: limit {bound.fd_limit} (ulimit -n) less {_RESERVED_FDS} / {ENGINE_FDS} per engine = {bound.by_fds}"
        )
    raise CliError(f"{flag} {engines} is more than this machine holds: at most {bound.engines} ({'; '.join(reasons)})", 2)


@dataclass
class FleetRun:
    """One colocate run on the fleet: its report and the proxies it went through (their ``seen`` feeds the timeline)."""

    report: ColocateReport
    proxies: list[FaultProxy]


class FleetRunner:
    """``engines`` emulated engines, started once, serving any number of colocate runs under ``plan``; a context manager
    (entering starts the fleet, a :class:`CliError` naming an engine that did not start; leaving stops everything by PID)."""

    def __init__(
        self,
        engines: int,
        plan: FaultPlan,
        config: EngineConfig | VLLMEngineConfig = DEMO_ENGINE,
        on_ready: Callable[[int], None] | None = None,
    ) -> None:
        self.on_ready = on_ready
        """Called with an engine's index once it serves, while entering; None = silent."""
        self.plan = plan
        self.fleet = EmulatedFleet(engines, config)
        """The engines (no proxies of their own)."""
        self._proxies: list[FaultProxy] = []

    def __enter__(self) -> FleetRunner:
        try:
            self.fleet.start(on_ready=self.on_ready)
        except EmulatorStartError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CliError(f"emulated engines did not start: {first}") from None
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop every proxy, then every engine (SIGTERM, bounded wait, SIGKILL). Idempotent."""
        try:
            for proxy in self._proxies:
                proxy.stop()
        finally:
            self.fleet.stop()

    def pids(self) -> list[int]:
        """The engine processes' PIDs right now (a restarted engine has a new one)."""
        return [e.pid for e in self.fleet.engines]

    def labels(self, proxies: Sequence[FaultProxy] = ()) -> dict[str, str]:
        """``{base URL: "engine i"}`` for each engine's own URL and its proxy's (``proxies`` in engine order), for
        ``short_error``; read again after a restart (a restarted engine may serve on a new port)."""
        from resilience.cli.errors_text import engine_labels

        urls = {e.index: [e.direct_url] for e in self.fleet.engines}
        for i, proxy in enumerate(proxies):
            urls[i].append(proxy.url)
        return engine_labels(urls)

    def memory_pids(self) -> list[int]:
        """Every process the engines cost memory in: the engines and the zygote they are forked from."""
        zygote = self.fleet.zygote_pid
        return [*self.pids(), *([zygote] if zygote is not None else [])]

    def run(
        self,
        kind: LoopKind,
        config: ColocateConfig,
        *,
        engine: EngineKind = "sglang",
        observers: Sequence[Observer] = (),
        budget: RestartBudget | None = None,
        progress: Callable[[StepProgress], None] | None = None,
        on_proxies: Callable[[list[FaultProxy]], None] | None = None,
        last: bool = False,
    ) -> FleetRun:
        """Run the colocate loop ``kind`` through fresh proxies (``on_proxies`` sees them before the first step).

        ``engine``: ``"sglang"`` (default) or ``"vllm"`` (a fleet of ``VLLM_DEMO_ENGINE``). ``last``: no run follows on
        this fleet, so a run that spends its restart budget leaves its dead engines dead.
        """
        proxies = [FaultProxy(e.direct_url, self.plan, e.index, seen_limit=PROXY_RECORDS) for e in self.fleet.engines]
        self._proxies.extend(proxies)
        for proxy in proxies:
            proxy.start()
        if on_proxies is not None:
            on_proxies(proxies)
        try:
            report = run_colocate(
                self.fleet, config, kind, engine=engine, observers=observers, restart_budget=budget, progress=progress,
                proxies=proxies, recover_when_spent=not last,
            )  # fmt: skip
        finally:
            for proxy in proxies:
                proxy.stop()
        return FleetRun(report, proxies)

    def run_controller_restart(self, kind: LoopKind, *, observers: Sequence[Observer] = ()) -> ColocateReport:
        """One colocate step of ``kind`` whose controller dies while the engines train (no faults, no proxies): the
        baseline's new controller releases again and kills the engines (left dead: call this last on a fleet), ours
        starts on the journal."""
        return run_colocate(
            self.fleet, CONTROLLER_RESTART, kind, observers=observers, restart_budget=RestartBudget(0), recover_when_spent=False
        )


# -- telemetry --------------------------------------------------------------------------------


@dataclass
class Telemetry:
    """The observers of a run and what must be stopped afterwards."""

    observers: list[Observer]
    metrics: Any
    """The ``MetricsObserver`` (its ``registry`` is served at :attr:`metrics_url`)."""
    metrics_url: str
    """``http://127.0.0.1:<port>/metrics``."""
    _closers: list[Callable[[], str | None]]

    def close(self) -> list[str]:
        """Flush traces and stop the metrics server (every closer runs); returns what the closers had to say."""
        errors, said = [], []
        for closer in reversed(self._closers):
            try:
                line = closer()
            except Exception as exc:  # a collector that went away must not hide the run's result
                errors.append(exc)
                continue
            if line:
                said.append(line)
        self._closers.clear()
        if errors:
            print(f"warning: telemetry shutdown: {type(errors[0]).__name__}: {errors[0]}", file=sys.stderr)
        return said


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def start_telemetry(metrics_port: int, traces: str, spans_file: Path | None = None) -> Telemetry:
    """A ``MetricsObserver`` served on 127.0.0.1:``metrics_port`` and, unless ``traces == "off"``, a ``TracingObserver``
    (``"console"``: into ``spans_file``; ``"otlp"``: to the collector, checked first). A port in use or no collector
    is a :class:`CliError`, with nothing left running."""
    need("prometheus_client", "metrics", "serving /metrics")
    from resilience.telemetry.metrics import MetricsObserver, start_metrics_server

    metrics = MetricsObserver()
    try:
        server = start_metrics_server(metrics_port, "127.0.0.1", registry=metrics.registry)
    except OSError as exc:
        raise CliError(f"cannot serve /metrics on 127.0.0.1:{metrics_port}: {exc.strerror or exc}") from None

    closers: list[Callable[[], str | None]] = [lambda: server.close()]
    observers: list[Observer] = [metrics]
    if traces != "off":
        try:
            need("opentelemetry.trace", "otel", "--traces")
            from resilience.cli.traces import tracer_provider
            from resilience.telemetry.tracing import TracingObserver

            provider, shutdown = tracer_provider(traces, spans_file, _to_stderr)
        except BaseException:
            server.close()
            raise
        closers.append(shutdown)
        observers.append(TracingObserver(tracer_provider=provider))
    return Telemetry(observers, metrics, f"http://127.0.0.1:{server.port}/metrics", closers)


_TOTALS = ("cpr_requests_total", "cpr_attempts_total", "cpr_retries_total", "cpr_restarts_total", "cpr_restart_budget_remaining")


def metric_totals(registry: CollectorRegistry) -> dict[str, float]:
    """Totals read back from the run's ``MetricsObserver`` registry (``cpr_restart*``: the budget published last)."""
    out = dict.fromkeys(_TOTALS, 0.0)
    out["cpr_retries_total{reason=status_502}"] = 0.0
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name in out:
                out[sample.name] += sample.value
            if sample.name == "cpr_retries_total" and sample.labels.get("reason") == "status_502":
                out["cpr_retries_total{reason=status_502}"] += sample.value
    return out
