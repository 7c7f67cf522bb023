"""``cpr demo``: colocated RL steps on emulated engines under the seed's faults, the old way and ours, side by side.

- ``--engine sglang`` (default): one fleet serves both runs, each through fresh fault proxies playing
  ``demo_plan(seed)``, so the same seed gives the same faults whichever run comes first. Ours runs first; the
  baseline second, leaving the engines it killed dead once its budget is spent. After each run one more step,
  without faults, whose controller dies while the engines train (``FleetRunner.run_controller_restart``): the
  baseline's new controller releases again and kills the engines, ours resumes from the journal. Metrics are
  served on 127.0.0.1, and traces optionally exported.
- ``--engine vllm``: vLLM 0.33.0 engines under ``vllm_demo_plan(seed)``, SkyRL's colocated sequence against the
  barrier with the vLLM rules; the table adds the completions answered 200 from garbage weights.
- ``--router smg``: behind a real smg 1.13.0 gateway, smg's own client against ours direct and ours through
  ``SmgFanOut`` (the ``[smg]`` extra).

``--engines`` is bounded before anything starts by this machine's available memory and file-descriptor limit
(``fleet.engines_bound``). SIGINT (Ctrl-C, or ``kill -INT`` to this process alone) stops the demo within about a
second, every engine stopped by PID; the finished runs' table and report are still written (exit status 130).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from resilience.barrier.journal import RestartBudget
from resilience.cli.churn import MEMBERSHIP_FLEET, membership_scene
from resilience.cli.common import CliError, check_output_file, plural, write_json
from resilience.cli.errors_text import safe_url, short_error
from resilience.cli.fleet import (
    DEMO_AMBIGUOUS,
    VLLM_DEMO_ENGINE,
    FleetRunner,
    Telemetry,
    check_engines,
    demo_plan,
    metric_totals,
    start_telemetry,
    vllm_demo_plan,
)
from resilience.cli.render import RunProgress, comparison_rows, make_console, rich_table
from resilience.cli.story import death_causes, membership_story, per_step, rates_note, story
from resilience.cli.timeline import StepTimeline, TimelineRecorder, write_timeline
from resilience.cli.watch import StepWatch
from resilience.testing.churn import ChurnReport
from resilience.testing.colocate import ColocateConfig, StepProgress, run_colocate
from resilience.testing.faults import FaultPlan, FaultProxy
from resilience.testing.lab import BASELINE, RESILIENT, ColocateReport, LoopKind
from resilience.testing.lab_sglang import demo_policies

__all__ = ["LOOPS", "RUN_ORDER", "VLLM_LOOPS", "run_demo"]

LOOPS: tuple[tuple[LoopKind, str], ...] = ((BASELINE, "old way"), (RESILIENT, "ours"))
"""The two loops (the baseline, the resilient one) in table order, with their column titles."""
RUN_ORDER: tuple[LoopKind, ...] = (RESILIENT, BASELINE)
"""The order the loops run in: the baseline last, so the engines its controller restart kills need no restart."""


def _chain(*callbacks: Callable[[StepProgress], None]) -> Callable[[StepProgress], None]:
    def call(p: StepProgress) -> None:
        for cb in callbacks:
            cb(p)

    return call


@dataclass
class _Results:
    """What the finished runs left: the report, table and picture are made of these (an interrupted demo too)."""

    reports: dict[str, ColocateReport] = field(default_factory=dict)
    timelines: dict[str, StepTimeline] = field(default_factory=dict)
    totals: dict[str, dict[str, float]] = field(default_factory=dict)
    restarts: dict[str, ColocateReport] = field(default_factory=dict)
    """Per loop, the controller-restart step's own report (``FleetRunner.run_controller_restart``)."""
    causes: dict[str, list[str]] = field(default_factory=dict)
    """Per loop, what killed each engine that died in it (from the engines' logs), oldest first."""
    membership: ChurnReport | None = None
    """The membership scene's report (``resilience.cli.churn.membership_scene``), once it ran."""

    def done(self) -> list[tuple[str, str]]:
        """(loop, title) of the finished runs, in table order."""
        return [(kind, title) for kind, title in LOOPS if kind in self.reports]


def _logs(runner: FleetRunner) -> list[str]:
    return [e.log() for e in runner.fleet.engines]


def _run_loops(args: argparse.Namespace, ui: RunProgress, telemetry: Telemetry, plan: FaultPlan, out: _Results) -> None:
    config = ColocateConfig(steps=args.steps, seed=args.seed)
    started = ui.counter(f"starting {plural(args.engines, 'emulated engine')}", args.engines)
    with FleetRunner(args.engines, plan, on_ready=started) as runner:
        ui.print(f"engines ready: pids {' '.join(map(str, runner.pids()))}")
        for kind in RUN_ORDER:
            title = dict(LOOPS)[kind]
            before = metric_totals(telemetry.metrics.registry)
            logs_before = _logs(runner)
            budget = RestartBudget(config.restart_limit)
            telemetry.metrics.publish_restart_budget(budget)
            recorder = TimelineRecorder(title, runner.fleet)
            labels: dict[str, str] = {}  # base URL -> "engine i": how a failed step's line names engines

            def attach(proxies: list[FaultProxy], recorder: TimelineRecorder = recorder, labels: dict[str, str] = labels) -> None:
                recorder.attach(proxies)
                labels.update(runner.labels(proxies))
                # the breaker panel says "closed" (and the rare-event counters 0) before the first call
                telemetry.metrics.declare(engines=[p.url for p in proxies], endpoints=[key for key, _ in demo_policies()])

            def budget_note(budget: RestartBudget = budget) -> str:
                return f"budget left {budget.remaining}"

            def say(text: str, title: str = title) -> None:
                ui.note(title, text)

            with StepWatch(runner.fleet, say) as watch:
                def relabel(_p: StepProgress, recorder: TimelineRecorder = recorder, labels: dict[str, str] = labels) -> None:
                    labels.update(runner.labels(recorder.proxies))  # a restarted engine may serve on a new port

                progress = _chain(watch, relabel, ui.run_progress(title, config.steps, budget_note, labels), recorder)
                run = runner.run(
                    kind,
                    config,
                    observers=telemetry.observers,
                    budget=budget,
                    progress=progress,
                    on_proxies=attach,
                )
            out.causes[kind] = [c for old, new in zip(logs_before, _logs(runner), strict=True) for c in death_causes(new[len(old) :])]
            restart = out.restarts[kind] = runner.run_controller_restart(kind, observers=telemetry.observers)
            run.report.controller_restarts = restart.controller_restarts
            run.report.controller_restart_deaths = restart.engine_deaths
            out.reports[kind] = run.report  # finished: from here on a Ctrl-C still writes its report
            ui.run_ended(title, run.report)
            after = metric_totals(telemetry.metrics.registry)  # counters: this run's share; restarts: its budget
            out.totals[kind] = {k: after[k] - (0 if k.startswith("cpr_restart") else before[k]) for k in after}
            if recorder.captured is not None:
                out.timelines[kind] = recorder.captured


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; the exit status: 0 when ours finished every step; 2, before anything starts,
    for ``--engine vllm`` with the SGLang demo's options or ``--engines`` beyond ``fleet.engines_bound()``; 130 on
    Ctrl-C after a run finished (the finished runs' table and report are still written)."""
    engine, router = args.engine, args.router
    if engine == "vllm":
        unsupported = [flag for flag, given in (("--timeline", args.timeline), ("--traces", args.traces != "off")) if given]
        if router != "direct":
            unsupported.append("--router")
        if unsupported:
            raise CliError(f"cpr demo --engine vllm does not take {', '.join(unsupported)} (the SGLang demo's options)", 2)
    check_engines(args.engines, "--engines")
    if engine == "vllm":
        return _vllm_demo(args)
    if router == "smg":
        return _smg_demo(args)
    return _sglang_demo(args)


def _sglang_demo(args: argparse.Namespace) -> int:
    """The SGLang demo (the module docstring's first case) from parsed arguments."""
    report_path = check_output_file(Path(args.report), "--report", (".json",))
    timeline_path = check_output_file(Path(args.timeline), "--timeline", (".png", ".html", ".htm")) if args.timeline else None
    spans_path = check_output_file(Path(args.traces_file), "--traces-file") if args.traces == "console" else None
    plan = demo_plan(args.seed)
    t_start = time.monotonic()
    telemetry: Telemetry = start_telemetry(args.metrics_port, args.traces, spans_path)
    out = _Results()
    interrupted = False
    try:
        with RunProgress() as ui:
            ui.print(f"metrics: {telemetry.metrics_url} (served while the demo runs)")
            if args.traces == "console":
                ui.print(f"traces: one JSON object per span into {spans_path} (not into this progress)")
            elif args.traces == "otlp":
                from resilience.cli.traces import otlp_endpoint

                ui.print(f"traces: OTLP to {safe_url(otlp_endpoint())} (a collector answered)")
            _run_loops(args, ui, telemetry, plan, out)
            ui.print("membership: one engine joins the offloaded group, one leaves")
            out.membership = membership_scene()
    except KeyboardInterrupt:
        if not out.reports:
            raise
        interrupted = True
    finally:
        said = telemetry.close()
    done = out.done()
    rows = comparison_rows([out.reports[kind] for kind, _ in done])
    columns = ["", *(title for _, title in done)]
    told = story({kind: out.reports[kind] for kind, _ in done}, out.causes, dict(LOOPS))
    if out.membership is not None:
        told += " " + membership_story(out.membership, MEMBERSHIP_FLEET)
    caption = (
        f"{plural(args.engines, 'engine')}, {plural(args.steps, 'step')}, seed {args.seed}: "
        "502s (and resets) on every per-step control call, "
        f"slow swaps; a reset or read timeout after the engine acted on each engine's first release and on {DEMO_AMBIGUOUS:.0%} "
        "of releases, resumes and continues; restart budget 3 (the seed's max_global_restart). Then one step more, "
        "without faults, whose controller dies while the engines train and a new one runs it again from its offload"
    )
    console = make_console()
    heading = "cpr demo: colocated RL steps, the old way and ours" + (" (interrupted: finished ways only)" if interrupted else "")
    console.print(rich_table(heading, columns, rows, caption=caption))
    note = rates_note({kind: out.reports[kind] for kind, _ in done}, dict(LOOPS))
    if note:
        console.print(note, markup=False, highlight=False, soft_wrap=True)
    console.print(told, markup=False, highlight=False, soft_wrap=True)
    drawn = [out.timelines[kind] for kind, _ in done if kind in out.timelines]
    if timeline_path is not None and drawn:
        write_timeline(timeline_path, drawn)
        console.print(f"timeline: {timeline_path}", markup=False, highlight=False)
    for line in said:  # traces: how many spans went where
        console.print(line, markup=False, highlight=False)
    data = _report_of(args, plan.to_dict(), {kind: out.reports[kind].to_dict() for kind, _ in done}, columns, rows)
    data |= {
        "interrupted": interrupted,
        "engine_death_causes": {kind: out.causes.get(kind, []) for kind, _ in done},
        "controller_restart": {kind: out.restarts[kind].to_dict() for kind, _ in done if kind in out.restarts},
        "story": told,
        "membership": None if out.membership is None else out.membership.to_dict(),
        "rates_note": note,
        "metrics": {"url": telemetry.metrics_url, "per_way": out.totals},
        "traces": args.traces,
        "traces_file": str(spans_path) if spans_path is not None else None,
        "timeline": {"file": str(timeline_path) if timeline_path and drawn else None, "steps": [t.to_dict() for t in drawn]},
    }
    _write_report(report_path, data, t_start)
    if interrupted:
        finished = " and ".join(title for _, title in done)
        print(f"cpr demo: interrupted; the report holds what finished ({finished})", file=sys.stderr)
        return 130
    resilient = out.reports[RESILIENT]
    if resilient.failed_steps or resilient.engine_deaths:
        failed, deaths = plural(resilient.failed_steps, "step"), plural(resilient.engine_deaths, "engine death")
        first = short_error(resilient.failures[0]) if resilient.failures else "no error recorded"
        raise CliError(f"ours failed {failed} with {deaths}; the first: {first}")
    return 0


def _progress(p: StepProgress) -> None:
    mark = "ok" if p.ok else f"failed: {p.error}"
    print(f"{p.way}: step {p.step}/{p.steps} {mark}", file=sys.stderr, flush=True)


def _report_of(
    args: argparse.Namespace, plan: object, ways: object, columns: list[str], rows: list[list[str]], **which: str
) -> dict[str, object]:
    """A demo report's head: the run's arguments (``which``: its engine or router), plan, ways and table."""
    head: dict[str, object] = {"command": "demo", **which, "seed": args.seed, "engines": args.engines, "steps": args.steps}
    return head | {"fault_plan": plan, "ways": ways, "table": {"columns": columns, "rows": rows}}


def _write_report(path: Path, data: dict[str, object], t0: float) -> None:
    data["wall_s"] = round(time.monotonic() - t0, 3)
    write_json(path, data)
    make_console().print(f"report: {path} ({data['wall_s']:.0f} s in all)", markup=False, highlight=False)


VLLM_LOOPS = ((BASELINE, "old way (SkyRL)"), (RESILIENT, "ours"))
"""The vLLM demo's two loops in table order, with their column titles."""


def _vllm_demo(args: argparse.Namespace) -> int:
    """``--engine vllm``: both ways on emulated vLLM engines, each through fresh proxies playing ``vllm_demo_plan(seed)``."""
    from resilience.testing.emulator import EmulatedFleet
    from resilience.testing.lab_vllm import OLD_WAY_CAP_S, SKYRL_SLEEP_LEVEL

    report_path = check_output_file(Path(args.report), "--report", (".json",))
    plan = vllm_demo_plan(args.seed)
    config = ColocateConfig(steps=args.steps, seed=args.seed)
    t0 = time.monotonic()
    reports: dict[str, ColocateReport] = {}
    print(f"starting {plural(args.engines, 'emulated vLLM engine')}", file=sys.stderr, flush=True)
    with EmulatedFleet(args.engines, VLLM_DEMO_ENGINE) as fleet:
        for kind in (RESILIENT, BASELINE):
            proxies = [FaultProxy(e.direct_url, plan, e.index) for e in fleet.engines]
            for proxy in proxies:
                proxy.start()
            try:
                reports[kind] = run_colocate(fleet, config, kind, engine="vllm", progress=_progress, proxies=proxies)
            finally:
                for proxy in proxies:
                    proxy.stop()
    columns = ["", *(title for _, title in VLLM_LOOPS)]
    ordered = [reports[kind] for kind, _ in VLLM_LOOPS]
    rows = comparison_rows(ordered)
    rows.insert(-1, ["completions answered 200 from garbage weights", *(per_step(r.garbage_completions, r) for r in ordered)])
    caption = (
        f"{args.engines} vLLM 0.33.0 engines (emulated), {args.steps} steps, seed {args.seed}: 502s on every control call of "
        f"the RL transaction, a reset after each engine's first sleep, resets and hangs after the engine acted on "
        f"{DEMO_AMBIGUOUS:.0%} of sleeps, wakes and weight calls; restart budget 3. The old way is SkyRL's: sleep level "
        f"{SKYRL_SLEEP_LEVEL}, wake weights, broadcast, wake kv_cache, each phase a bare asyncio.gather with no retry and no "
        f"timeout (cut here after {OLD_WAY_CAP_S:g} s); ours is the barrier with the vLLM rules (sleep level 1)"
    )
    make_console().print(rich_table("cpr demo --engine vllm: SkyRL's sequence and ours", columns, rows, caption=caption))
    ways = {kind: reports[kind].to_dict() for kind, _ in VLLM_LOOPS}
    data = _report_of(args, plan.to_dict(), ways, columns, rows, engine="vllm")
    _write_report(report_path, data, t0)
    ours = reports[RESILIENT]
    if ours.failed_steps or ours.engine_deaths:
        failed, deaths = plural(ours.failed_steps, "step"), plural(ours.engine_deaths, "engine death")
        raise CliError(f"ours failed {failed} with {deaths}: {ours.failures[:1]}")
    return 0


def _smg_demo(args: argparse.Namespace) -> int:
    """``--router smg``: the three ways behind a fresh smg gateway each (``resilience.testing.lab_smg``); exit status 0
    when both of ours finished every step with no engine death."""
    from resilience.testing.smg import smg_available

    if not smg_available():
        raise CliError("cpr demo --router smg needs smg: pip install 'controlplane-resilience[smg]'", 2)
    from resilience.testing.emulator import EmulatedFleet, EngineConfig
    from resilience.testing.lab_smg import PEER_WAYS, peer_rows

    report_path = check_output_file(Path(args.report), "--report", (".json",))
    plan = demo_plan(args.seed)
    config = ColocateConfig(steps=args.steps, seed=args.seed, stragglers=0)
    t0 = time.monotonic()
    reports: dict[str, ColocateReport] = {}
    print(f"starting {plural(args.engines, 'emulated engine')}", file=sys.stderr, flush=True)
    with EmulatedFleet(args.engines, EngineConfig(health_poll_seconds=0.05)) as fleet:
        for way, _ in PEER_WAYS:
            reports[way] = run_colocate(fleet, config, way, route="smg", plan=plan, progress=_progress)
    columns = ["", *(title for _, title in PEER_WAYS)]
    rows = peer_rows([reports[w] for w, _ in PEER_WAYS])
    caption = (
        f"{args.engines} engines, {args.steps} steps, seed {args.seed}, behind smg 1.13.0: cpr demo's faults between the gateway "
        "and the engines; smg's client is RL.fanout per phase and smg.rl.paused around the weight update (no retries; "
        "paused() sends continue on the way out, also after a body that released memory); restart budget 3"
    )
    make_console().print(rich_table("cpr demo --router smg: smg's own client vs ours", columns, rows, caption=caption))
    ways = {way: reports[way].to_dict() for way, _ in PEER_WAYS}
    data = _report_of(args, plan.to_dict(), ways, columns, rows, router="smg")
    _write_report(report_path, data, t0)
    bad = [w for w in ("ours", "ours-smg") if reports[w].failed_steps or reports[w].engine_deaths]
    if bad:
        raise CliError(f"{', '.join(bad)} failed: {[reports[w].failures[:1] for w in bad]}")
    return 0
