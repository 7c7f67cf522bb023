"""``cpr demo``: the colocate loop on emulated engines under the seed's faults, the old way and ours, side by side.

One fleet of emulated engines serves both runs (each engine imports torch, so
starting a fleet is the slow part); each run goes through fresh fault proxies
playing ``demo_plan(seed)`` (the seed's faults plus resets and read timeouts after
the engine acted on release, resume and continue), so the same seed gives the same faults
whichever run comes first. Ours runs first, on the fresh fleet; the old way
runs second and, once its restart budget is spent, leaves the engines it
killed dead (the run is over and the fleet is stopped next), which saves one
round of engine restarts. The table shows the old way first. A
MetricsObserver (served on 127.0.0.1) and, optionally, a TracingObserver are
attached to both runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from resilience.budget import RestartBudget
from resilience.cli_common import CliError, check_output_file, write_json
from resilience.cli_render import RunProgress, comparison_rows, make_console, rich_table
from resilience.cli_run import DEMO_AMBIGUOUS, FleetRunner, Telemetry, demo_plan, metric_totals, start_telemetry
from resilience.cli_timeline import StepTimeline, TimelineRecorder, write_timeline
from resilience.testing.colocate import ColocateConfig, ColocateReport, StepProgress
from resilience.testing.faults import FaultProxy

__all__ = ["RUN_ORDER", "WAYS", "run_demo"]

WAYS: tuple[tuple[Literal["old", "ours"], str], ...] = (("old", "old way"), ("ours", "ours"))
"""The ways in table order, with their column titles."""
RUN_ORDER: tuple[Literal["old", "ours"], ...] = ("ours", "old")
"""The order the ways run in: the old way last, so its final engine deaths need no restart."""


def _chain(*callbacks: Callable[[StepProgress], None]) -> Callable[[StepProgress], None]:
    def call(p: StepProgress) -> None:
        for cb in callbacks:
            cb(p)

    return call


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; returns the exit status (0 when ours finished every step)."""
    report_path = check_output_file(Path(args.report), "--report", (".json",))
    timeline_path = check_output_file(Path(args.timeline), "--timeline", (".png", ".html", ".htm")) if args.timeline else None
    plan = demo_plan(args.seed)
    config = ColocateConfig(steps=args.steps, seed=args.seed)
    t_start = time.monotonic()
    telemetry: Telemetry = start_telemetry(args.metrics_port, args.traces)
    reports: dict[str, ColocateReport] = {}
    timelines: dict[str, StepTimeline] = {}
    totals: dict[str, dict[str, float]] = {}
    try:
        with RunProgress() as ui:
            ui.print(f"metrics: {telemetry.metrics_url} (served while the demo runs)")
            if args.traces != "off":
                ui.print(f"traces: {args.traces}")
            done = ui.task(f"starting {args.engines} emulated engines")
            with FleetRunner(args.engines, plan) as runner:
                done(f"pids {' '.join(map(str, runner.pids()))}")
                for way in RUN_ORDER:
                    title = dict(WAYS)[way]
                    before = metric_totals(telemetry.metrics.registry)
                    budget = RestartBudget(config.restart_limit)
                    telemetry.metrics.publish_restart_budget(budget)
                    recorder = TimelineRecorder(title, runner.fleet)

                    def attach(proxies: list[FaultProxy], recorder: TimelineRecorder = recorder) -> None:
                        recorder.attach(proxies)

                    def budget_note(budget: RestartBudget = budget) -> str:
                        return f"budget left {budget.remaining}"

                    progress = _chain(ui.way(title, config.steps, budget_note), recorder)
                    run = runner.run(
                        way,
                        config,
                        observers=telemetry.observers,
                        budget=budget,
                        progress=progress,
                        on_proxies=attach,
                        last=way == RUN_ORDER[-1],
                    )
                    ui.way_ended(title, run.report)
                    reports[way] = run.report
                    after = metric_totals(telemetry.metrics.registry)  # counters: this way's share; restarts: its budget
                    totals[way] = {k: after[k] - (0 if k.startswith("cpr_restart") else before[k]) for k in after}
                    if recorder.captured is not None:
                        timelines[way] = recorder.captured
    finally:
        telemetry.close()
    in_order = [reports[way] for way, _ in WAYS]
    drawn = [timelines[way] for way, _ in WAYS if way in timelines]
    rows = comparison_rows(in_order)
    columns = ["", *(title for _, title in WAYS)]
    caption = (
        f"{args.engines} engines, {args.steps} steps, seed {args.seed}: 502s (and resets) on every per-step control call, "
        f"slow swaps; a reset or read timeout after the engine acted on each engine's first release and on {DEMO_AMBIGUOUS:.0%} "
        "of releases, resumes and continues; restart budget 3 (the seed's max_global_restart)"
    )
    console = make_console()
    console.print(rich_table("cpr demo: colocated RL steps, the old way and ours", columns, rows, caption=caption))
    if timeline_path is not None:
        write_timeline(timeline_path, drawn)
        console.print(f"timeline: {timeline_path}", markup=False, highlight=False)
    data = {
        "command": "demo",
        "seed": args.seed,
        "engines": args.engines,
        "steps": args.steps,
        "fault_plan": plan.to_dict(),
        "ways": {way: reports[way].to_dict() for way, _ in WAYS},
        "table": {"columns": columns, "rows": rows},
        "metrics": {"url": telemetry.metrics_url, "per_way": totals},
        "traces": args.traces,
        "timeline": {"file": str(timeline_path) if timeline_path else None, "steps": [t.to_dict() for t in drawn]},
        "wall_s": round(time.monotonic() - t_start, 3),
    }
    write_json(report_path, data)
    console.print(f"report: {report_path} ({data['wall_s']:.0f} s in all)", markup=False, highlight=False)
    ours = reports["ours"]
    if ours.failed_steps or ours.engine_deaths:
        raise CliError(f"ours failed {ours.failed_steps} step(s) with {ours.engine_deaths} engine death(s): {ours.failures[:1]}")
    return 0
