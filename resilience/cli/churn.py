"""``cpr soak --churn``: the colocate sequence while engines are killed mid-offload and restarted, spares join and
engines leave (``resilience.testing.churn``). The verdict: zero engine deaths a barrier call caused, zero requests
lost, zero failed steps, every restarted engine back in service at the end.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from resilience.cli.common import CliError, check_output_file, plural, write_json
from resilience.cli.fleet import DEMO_ENGINE, check_engines
from resilience.cli.render import make_console, rich_table
from resilience.cli.story import death_causes
from resilience.testing.churn import ChurnConfig, ChurnReport, run_churn
from resilience.testing.emulator import EmulatedFleet, EmulatorStartError

__all__ = ["MEMBERSHIP_FLEET", "SPARES", "churn_verdict", "membership_scene", "run_churn_soak"]

SPARES = 2
"""Engines started beside the group, for the spares that join (and the retired ones go back to)."""
MEMBERSHIP_FLEET = 3
"""The engines of ``cpr demo``'s membership scene: a group of two and one spare."""


def membership_scene() -> ChurnReport:
    """``cpr demo``'s membership scene: two colocate steps on a group of two engines; in the first a spare joins the
    offloaded group (paused, flushed and released first), in the second one engine leaves (``retire``)."""
    config = ChurnConfig(engines=MEMBERSHIP_FLEET - 1, steps=2, kill_every=0, add_every=1, retire_every=2, min_engines=1)
    try:
        with EmulatedFleet(MEMBERSHIP_FLEET, DEMO_ENGINE) as fleet:
            return run_churn(fleet, config, deaths=death_causes)
    except EmulatorStartError as exc:
        raise CliError(f"emulated engines did not start: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def churn_verdict(report: ChurnReport) -> dict[str, bool]:
    """The churn soak's end criteria."""
    return {
        "no_deaths": report.engine_deaths == 0,
        "no_requests_lost": report.requests_lost == 0,
        "no_failed_steps": report.failed_steps == 0,
        "restarted_back": report.restarted_back,
    }


def run_churn_soak(args: argparse.Namespace) -> int:
    """``cpr soak --churn K``: exit 0 when every end criterion is met, else 1."""
    report_path = check_output_file(Path(args.report), "--report", (".json",))
    check_engines(args.engines, "--engines")
    if args.engine != "sglang" or args.way != "ours" or args.fault_plan:
        raise CliError("cpr soak --churn runs SGLang engines the resilient way without a fault plan: drop --engine, --way, --fault-plan", 2)
    every = args.churn
    config = ChurnConfig(
        engines=args.engines, steps=args.steps, seed=args.seed or 0, kill_every=every, add_every=every + 2, retire_every=2 * every + 1
    )
    console = make_console()
    t_start = time.monotonic()
    last = [0.0]

    def progress(n: int, r: ChurnReport) -> None:
        now = time.monotonic()
        if now - last[0] >= 5 or n + 1 == config.steps:
            last[0] = now
            console.print(
                f"step {n + 1}/{config.steps}: {r.kills} killed, {r.restarts} restarted, {r.joins} joined, {r.leaves} left, "
                f"{r.fenced} fenced, {r.engine_deaths} deaths, {r.requests_lost}/{r.requests_sent} requests lost",
                markup=False,
                highlight=False,
            )

    try:
        with EmulatedFleet(args.engines + SPARES, DEMO_ENGINE) as fleet:
            report = run_churn(fleet, config, deaths=death_causes, progress=progress)
    except EmulatorStartError as exc:
        raise CliError(f"emulated engines did not start: {_first_line(exc)}") from None
    verdict = churn_verdict(report)
    rows = [
        ["steps (failed)", f"{report.steps} ({report.failed_steps})"],
        ["engines killed inside an offload (flush phase), restarted on their URL", f"{report.kills}, {report.restarts}"],
        ["joins (known engines taken as new processes: restarted, or retired and back)", f"{report.joins} ({report.replaced})"],
        ["engines fenced by partial progress (min_engines), left (retire)", f"{report.fenced}, {report.leaves}"],
        ["engine deaths (from their logs)", str(report.engine_deaths)],
        ["requests lost / sent", f"{report.requests_lost} / {report.requests_sent}"],
        ["every restarted engine serving at the end", "yes" if report.restarted_back else "NO"],
        ["end criteria", "met" if all(verdict.values()) else "missed: " + ", ".join(k for k, ok in verdict.items() if not ok)],
    ]
    caption = (
        f"{plural(args.engines, 'engine')} + {SPARES} spares, {plural(args.steps, 'step')}, seed {config.seed}: "
        f"a kill every {config.kill_every} steps, a join every {config.add_every}, a leave every {config.retire_every}"
    )
    console.print(rich_table("cpr soak --churn", ["", "ours"], rows, caption=caption))
    wall = round(time.monotonic() - t_start, 1)
    data = {"command": "soak", "churn": config.kill_every, "config": {"engines": args.engines, "steps": args.steps, "seed": config.seed},
            "verdict": verdict, "report": report.to_dict(), "wall_s": wall}
    write_json(report_path, data)
    console.print(f"report: {report_path} ({wall} s)", markup=False, highlight=False)
    return 0 if all(verdict.values()) else 1
