"""``cpr demo``: the colocate loop on emulated engines under the seed's faults, baseline ("old way") and resilient ("ours").

One fleet of emulated engines serves both runs (each engine imports torch, so
starting a fleet is the slow part); each run goes through fresh fault proxies
playing ``demo_plan(seed)`` (the seed's faults plus resets and read timeouts after
the engine acted on release, resume and continue), so the same seed gives the same faults
whichever run comes first. The resilient loop runs first, on the fresh fleet; the baseline
runs second and, once its restart budget is spent, leaves the engines it
killed dead (the run is over and the fleet is stopped next), which saves one
round of engine restarts. After its run, each loop plays one more step on the
fleet, without faults, whose controller dies while the engines train
(``FleetRunner.run_controller_restart``): the baseline's new controller starts
fresh and releases the engines' memory again, which kills them (the baseline
plays it last, so they are left dead); ours resumes from the journal. The
table shows the baseline first. A
MetricsObserver (served on 127.0.0.1) and, optionally, a TracingObserver are
attached to both runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from resilience.budget import RestartBudget
from resilience.cli.common import CliError, check_output_file, plural, write_json
from resilience.cli.errors_text import safe_url, short_error
from resilience.cli.fleet import DEMO_AMBIGUOUS, FleetRunner, Telemetry, demo_plan, metric_totals, start_telemetry
from resilience.cli.render import RunProgress, comparison_rows, make_console, rich_table
from resilience.cli.story import death_causes, rates_note, story
from resilience.cli.timeline import StepTimeline, TimelineRecorder, write_timeline
from resilience.cli.watch import StepWatch
from resilience.testing.colocate import BASELINE, RESILIENT, ColocateConfig, ColocateReport, LoopKind, StepProgress, demo_policies
from resilience.testing.faults import FaultPlan, FaultProxy

__all__ = ["LOOPS", "RUN_ORDER", "run_demo"]

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


def _vllm_demo(args: argparse.Namespace) -> int:
    """``--engine vllm``: refuses the options that apply to the SGLang demo only, then runs ``demo_vllm``."""
    unsupported = [flag for flag, given in (("--timeline", args.timeline), ("--traces", args.traces != "off")) if given]
    if getattr(args, "router", "none") != "none":
        unsupported.append("--router")
    if unsupported:
        raise CliError(f"cpr demo --engine vllm does not take {', '.join(unsupported)} (the SGLang demo's options)", 2)
    from resilience.cli.demo_vllm import run_vllm_demo

    return run_vllm_demo(args)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; returns the exit status (0 when ours finished every step).

    On Ctrl-C after a run finished, the table, report (and timeline) of the finished runs are still
    written, and the exit status is 130.
    """
    if getattr(args, "engine", "sglang") == "vllm":
        return _vllm_demo(args)
    if getattr(args, "router", "none") == "smg":
        from resilience.cli.demo_smg import run_smg_demo

        return run_smg_demo(args)
    report_path = check_output_file(Path(args.report), "--report", (".json",))
    timeline_path = check_output_file(Path(args.timeline), "--timeline", (".png", ".html", ".htm")) if args.timeline else None
    spans_path = check_output_file(Path(args.traces_file), "--traces-file") if args.traces == "console" else None
    plan = demo_plan(args.seed)
    t_start = time.monotonic()
    telemetry: Telemetry = start_telemetry(args.metrics_port, args.traces, spans_path)
    out = _Results()
    interrupted = False
    said: list[str] = []
    try:
        with RunProgress() as ui:
            ui.print(f"metrics: {telemetry.metrics_url} (served while the demo runs)")
            if args.traces == "console":
                ui.print(f"traces: one JSON object per span into {spans_path} (not into this progress)")
            elif args.traces == "otlp":
                from resilience.cli.traces import otlp_endpoint

                ui.print(f"traces: OTLP to {safe_url(otlp_endpoint())} (a collector answered)")
            _run_loops(args, ui, telemetry, plan, out)
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
    data = {
        "command": "demo",
        "seed": args.seed,
        "engines": args.engines,
        "steps": args.steps,
        "interrupted": interrupted,
        "fault_plan": plan.to_dict(),
        "ways": {kind: out.reports[kind].to_dict() for kind, _ in done},
        "engine_death_causes": {kind: out.causes.get(kind, []) for kind, _ in done},
        "controller_restart": {kind: out.restarts[kind].to_dict() for kind, _ in done if kind in out.restarts},
        "story": told,
        "rates_note": note,
        "table": {"columns": columns, "rows": rows},
        "metrics": {"url": telemetry.metrics_url, "per_way": out.totals},
        "traces": args.traces,
        "traces_file": str(spans_path) if spans_path is not None else None,
        "timeline": {"file": str(timeline_path) if timeline_path and drawn else None, "steps": [t.to_dict() for t in drawn]},
        "wall_s": round(time.monotonic() - t_start, 3),
    }
    write_json(report_path, data)
    console.print(f"report: {report_path} ({data['wall_s']:.0f} s in all)", markup=False, highlight=False)
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
