"""``cpr soak``: the colocate loop for many steps, with the memory of this process and the engines sampled each step.

Memory is flat when the mean of the last 10 % of steps is at most 5 % above that of the 10 % right after a
warm-up (the first 10 %), for this process (RSS, psutil) and for the engines with their zygote together (PSS,
``/proc/PID/smaps_rollup``: they share the zygote's pages). The engines are judged on their anonymous PSS
(``Pss_Anon``, where a leak grows; the whole PSS where the kernel has none): their file-backed pages are split
with every process mapping the same libraries, so the whole PSS is reported but not judged. A restarted engine is
sampled under its new PID. The proxies' and engines' own records are bounded (``MAX_CALLS`` fills around step 200).

The default plan is :func:`~resilience.cli.fleet.soak_plan`. Every ``--restart-every`` steps (default 50) the
resilient loop's controller is killed inside a seeded phase (``resilience.testing.controller_kill``) and a new one
starts on its journal; quarantined engines are reconciled through the emulator's memory probe only. The verdict:
zero deaths, zero failed steps, zero requests lost, engine memory flat.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilience.barrier.journal import RestartBudget
from resilience.cli.common import CliError, check_output_file, need, plural, write_json
from resilience.cli.fleet import DEMO_ENGINE, VLLM_DEMO_ENGINE, FleetRunner, check_engines, soak_plan, vllm_demo_plan
from resilience.cli.render import RunProgress, comparison_rows, make_console, rich_table
from resilience.testing.colocate import ColocateConfig, EngineKind, StepProgress
from resilience.testing.faults import FaultPlan, FaultPlanError, FaultProxy
from resilience.testing.lab import BASELINE, ColocateReport

__all__ = ["DEFAULT_RESTART_EVERY", "FLAT_GROWTH", "RssSampler", "memory_verdict", "pss_bytes", "run_soak", "seed_caption", "soak_verdict"]

FLAT_GROWTH = 0.05
"""Growth of mean memory still called flat, as a fraction: 5 % (the 10 % of steps after warm-up -> the last 10 %)."""

_MB = 1024 * 1024
DEFAULT_RESTART_EVERY = 50
"""``--restart-every``'s value when it is not given (SGLang engines; vLLM's loop kills no controller)."""


def pss_bytes(pid: int) -> tuple[int, int] | None:
    """The process's ``(PSS, anonymous PSS)`` in bytes from ``/proc/PID/smaps_rollup`` (one cheap read), or None
    where there is none. The anonymous part is ``Pss_Anon``; on a kernel without that field it is the whole PSS."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("Pss", "Pss_Anon"):
                    fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "Pss" not in fields:
        return None
    return fields["Pss"], fields.get("Pss_Anon", fields["Pss"])


@dataclass
class RssSampler:
    """RSS of this process and the engines' memory (PSS and its anonymous part, zygote included; RSS where PSS cannot
    be read), one sample per step (see the module docstring)."""

    pids: Callable[[], list[int]]
    """The PIDs the engines cost memory in (engines and their zygote), asked at each sample."""
    samples: list[dict[str, float]] = field(default_factory=list)

    def sample(self, step: int) -> dict[str, float]:
        """Read and keep one sample ``{"step", "self_mb", "engines_mb", "engines_anon_mb"}``; a vanished engine counts 0."""
        psutil = need("psutil", "cli", "cpr soak")
        own = psutil.Process(os.getpid()).memory_info().rss / _MB
        engines = anon = 0.0
        for pid in self.pids():
            pss = pss_bytes(pid)
            if pss is not None:
                engines += pss[0] / _MB
                anon += pss[1] / _MB
                continue
            try:
                rss = psutil.Process(pid).memory_info().rss / _MB
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            engines += rss
            anon += rss
        row = {"step": float(step), "self_mb": round(own, 2), "engines_mb": round(engines, 2), "engines_anon_mb": round(anon, 2)}
        self.samples.append(row)
        return row


def memory_verdict(samples: list[dict[str, float]], key: str) -> dict[str, Any]:
    """The 10 % of samples after a 10 % warm-up vs the last 10 % of ``key``: means in MB, growth, and whether it is flat."""
    if not samples:
        return {"first_mb": None, "last_mb": None, "growth_mb": None, "growth_pct": None, "flat": None, "window_steps": 0}
    k = max(1, math.ceil(len(samples) * 0.10))
    warmup = k if len(samples) >= 3 * k else 0
    first = statistics.fmean(s[key] for s in samples[warmup : warmup + k])
    last = statistics.fmean(s[key] for s in samples[-k:])
    growth = last - first
    pct = growth / first if first else 0.0
    means = {"first_mb": round(first, 1), "last_mb": round(last, 1), "growth_mb": round(growth, 1)}
    return means | {"growth_pct": round(100 * pct, 1), "flat": pct <= FLAT_GROWTH, "window_steps": k}


def _memory_cell(verdict: dict[str, Any]) -> str:
    if verdict["first_mb"] is None:
        return "-"
    flat = "flat" if verdict["flat"] else "GROWING"
    return f"{verdict['first_mb']:.1f} -> {verdict['last_mb']:.1f} MB ({verdict['growth_pct']:+.1f} %, {flat})"


def soak_verdict(report: ColocateReport, memory: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """The soak's end criteria: no engine died, no step failed, no request was lost, the engines' anonymous PSS flat
    (``memory["engines_anon"]``; None: not sampled). Their whole PSS (``memory["engines"]``) is reported, not judged."""
    return {
        "no_deaths": report.engine_deaths == 0,
        "no_failed_steps": report.failed_steps == 0,
        "no_requests_lost": report.requests_lost == 0,
        "engines_flat": memory["engines_anon"]["flat"],
    }


def _verdict_cell(verdict: dict[str, bool | None]) -> str:
    missed = [name.replace("_", " ") for name, ok in verdict.items() if ok is False]
    return "met" if not missed else "missed: " + ", ".join(missed)


def soak_rows(report: ColocateReport) -> list[list[str]]:
    """The soak's own rows after the comparison table's: controller restarts and how quarantined engines were reconciled."""
    restarts = f"{report.controller_restarts} ({report.controller_kills} mid-phase)"
    reconciles = f"{report.reconciles_probe} / {report.restarts_clean}"
    return [
        ["controller restarts: killed inside a phase, a new controller on the journal", restarts],
        ["reconciles by the barrier: from the memory probe / restarts that needed none", reconciles],
        ["releases and resumes whose 502/504/reset the client settled from the memory probe", str(report.probe_verdicts)],
    ]


def seed_caption(seed: int, plan_seed: int, *, from_file: bool, given: bool) -> str:
    """How the caption names the loop's ``seed`` and the plan's: ``seed 7 (the fault plan's)``, ``seed 3 (stragglers),
    fault plan seed 7`` or ``seed 3`` (``from_file``: the plan came from ``--fault-plan``; ``given``: so did ``--seed``)."""
    if not from_file:
        return f"seed {seed}"
    if not given:
        return f"seed {seed} (the fault plan's)"
    return f"seed {seed}" if seed == plan_seed else f"seed {seed} (stragglers), fault plan seed {plan_seed}"


def run_soak(args: argparse.Namespace) -> int:
    """Run the soak from parsed arguments; exit 0 when no step failed, no engine died and no request was lost, else 1.
    ``--churn K`` runs the churn loop instead (``resilience.cli.churn``)."""
    if args.churn:
        from resilience.cli.churn import run_churn_soak

        return run_churn_soak(args)
    report_path = check_output_file(Path(args.report), "--report", (".json",))
    check_engines(args.engines, "--engines")
    vllm = args.engine == "vllm"
    restart_every = args.restart_every if args.restart_every is not None else (0 if vllm else DEFAULT_RESTART_EVERY)
    if vllm and restart_every:
        raise CliError("cpr soak --engine vllm does not kill the controller: --restart-every takes only 0 there", 2)
    if args.fault_plan:
        try:
            plan = FaultPlan.load(args.fault_plan)
        except FaultPlanError as exc:
            raise CliError(f"bad --fault-plan: {exc}") from None
    elif vllm:
        plan = vllm_demo_plan(args.seed or 0)
    else:
        plan = soak_plan(args.seed or 0)
    seed = args.seed if args.seed is not None else plan.seed  # with a plan file and no --seed: the plan's, for everything
    need("psutil", "cli", "cpr soak")
    config = ColocateConfig(steps=args.steps, seed=seed, controller_kill_every=restart_every or None)
    title = "old way" if args.way == BASELINE else "ours"  # --way names the loop: "old" (the baseline) or "ours"
    t_start = time.monotonic()
    with RunProgress() as ui:
        what = "emulated vLLM engine" if vllm else "emulated engine"
        started = ui.counter(f"starting {plural(args.engines, what)}", args.engines)
        engine = VLLM_DEMO_ENGINE if vllm else DEMO_ENGINE
        with FleetRunner(args.engines, plan, engine, on_ready=started) as runner:
            ui.print(f"engines ready: pids {' '.join(map(str, runner.pids()))}")
            sampler = RssSampler(runner.memory_pids)
            sampler.sample(0)

            def rss_note() -> str:
                last = sampler.samples[-1]
                return f"rss self {last['self_mb']:.0f} MB, pss engines {last['engines_mb']:.0f} MB"

            labels: dict[str, str] = {}  # base URL -> "engine i": how a failed step's line names engines
            show = ui.run_progress(title, config.steps, rss_note, labels)
            proxies: list[FaultProxy] = []

            def on_step(p: StepProgress) -> None:
                sampler.sample(p.step)
                labels.update(runner.labels(proxies))  # a restarted engine may serve on a new port
                show(p)

            budget = RestartBudget(config.restart_limit)
            kind: EngineKind = "vllm" if vllm else "sglang"  # vLLM's loop recovers after every step, the last too (stragglers)
            run = runner.run(args.way, config, engine=kind, budget=budget, progress=on_step, last=not vllm, on_proxies=proxies.extend)
            report = run.report
            ui.run_ended(title, report)
            proxy_records = sum(len(proxy.seen) for proxy in run.proxies)
    steps = sampler.samples[1:]  # the samples taken after each step
    memory = {name: memory_verdict(steps, f"{name}_mb") for name in ("self", "engines", "engines_anon")}
    rows = comparison_rows([report])
    rows.extend(soak_rows(report))
    rows.append(["RSS, this process: clients + fault proxies (after warm-up -> last 10 % of steps)", _memory_cell(memory["self"])])
    rows.append(["anonymous PSS, engines and their zygote (heap, tensors; same windows): judged", _memory_cell(memory["engines_anon"])])
    rows.append(["PSS, engines and zygote, with shared-library pages (same windows): not judged", _memory_cell(memory["engines"])])
    verdict = soak_verdict(report, memory)
    rows.append(["end criteria: no deaths, no failed steps, no requests lost, engines' anonymous PSS flat", _verdict_cell(verdict)])
    columns = ["", title]
    console = make_console()
    every = f"every {restart_every} steps" if restart_every else "never"
    seeds = seed_caption(seed, plan.seed, from_file=bool(args.fault_plan), given=args.seed is not None)
    caption = (
        f"{plural(args.engines, 'engine')}, {plural(args.steps, 'step')}, {seeds}, "
        f"controller killed {every}, "
        f"fault plan: {args.fault_plan or ('vllm_like + ambiguous' if vllm else 'seed_like + ambiguous + status_after')}"
        + (", vLLM 0.33.0 engines" if vllm else "")
    )
    console.print(rich_table("cpr soak", columns, rows, caption=caption))
    console.print(
        f"note: this process also runs the fault proxies ({proxy_records} request records at the end, bounded); "
        "the first 10 % of steps are warm-up and not compared; the engines keep a bounded record of their control calls; "
        "the engines' whole PSS includes their share of shared-library pages, which moves with other processes mapping them.",
        markup=False,
        highlight=False,
    )
    data = {
        "command": "soak",
        "seed": seed,
        "fault_plan_seed": plan.seed,
        "engines": args.engines,
        "steps": args.steps,
        "way": args.way,
        "restart_every": restart_every,
        "engine": kind,
        "verdict": verdict,
        "fault_plan": plan.to_dict(),
        "fault_plan_file": args.fault_plan,
        "ways": {args.way: report.to_dict()},
        "table": {"columns": columns, "rows": rows},
        "memory": {**memory, "samples": sampler.samples, "flat_threshold_pct": 100 * FLAT_GROWTH, "proxy_records": proxy_records},
        "wall_s": round(time.monotonic() - t_start, 3),
    }
    write_json(report_path, data)
    console.print(f"report: {report_path}", markup=False, highlight=False)
    return 0 if report.failed_steps == 0 and report.engine_deaths == 0 and report.requests_lost == 0 else 1
