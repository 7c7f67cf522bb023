"""What ``cpr demo`` tells in words: why engines died (read from their logs) and the run in one sentence.

An emulated engine dies as SGLang does (``emulator/crash.py``): ``Scheduler hit an exception: <traceback>`` then
SIGQUIT, or torch_memory_saver's ``[torch_memory_saver.cpp] ...`` line and ``exit(1)``. The client saw only a
dropped connection or a 502: :func:`death_causes` says what really happened.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from resilience.cli.common import plural

if TYPE_CHECKING:
    from resilience.testing.churn import ChurnReport
    from resilience.testing.lab import ColocateReport

__all__ = ["death_causes", "membership_story", "per_step", "rates_note", "steps_run", "story"]

_SCHEDULER_DEATH = "Scheduler hit an exception:"
_MEMORY_SAVER = "[torch_memory_saver.cpp]"

_CAUSES: tuple[tuple[str, str], ...] = (
    # (a regex over the traceback, the cause in words); first match wins
    (r"in write_prefill\b", "prefill scheduled after release"),
    (r"in write_decode\b", "decode step after release"),
    (r"in write_weights\b", "weight update into released memory"),
    (r"in _run_model\b", "forward pass after release"),
    (r"release_memory_occupation should be called only when server is idle", "release while requests were running"),  # SGLang's assert
    (r"in _resume\b[\s\S]*KeyError", "resume of memory that was not released"),  # scheduler.py: offload_tags.remove
)


def _one_cause(traceback: str) -> str:
    for pattern, cause in _CAUSES:
        if re.search(pattern, traceback):
            return cause
    lines = [line.strip() for line in traceback.splitlines() if line.strip()]
    return lines[-1][:120] if lines else "scheduler exception"


def death_causes(log: str) -> list[str]:
    """Each engine death in ``log`` (an emulated engine's stderr), oldest first, as a short cause: torch_memory_saver's
    line is "release sent twice"; a scheduler exception is named by where it happened, else by its last line."""
    causes: list[str] = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(_MEMORY_SAVER):
            text = line[len(_MEMORY_SAVER) :].strip()
            causes.append("release sent twice" if "not active" in text else f"memory saver: {text}")
        elif _SCHEDULER_DEATH in line:
            tail = []
            for follow in lines[i + 1 :]:
                if follow.startswith("["):  # the next log line: the traceback ended
                    break
                tail.append(follow)
            causes.append(_one_cause("\n".join(tail)))
    return causes


def steps_run(report: ColocateReport) -> int:
    """Steps the run went through, finished or failed."""
    return report.steps_finished + report.failed_steps


def per_step(count: int, report: ColocateReport) -> str:
    """``count`` with its rate per step run: ``480 (24.0/step)``; just the count when no step ran."""
    n = steps_run(report)
    return f"{count} ({count / n:.1f}/step)" if n else str(count)


def _causes_text(causes: Sequence[str]) -> str:
    counted = Counter(causes)
    return ", ".join(f"{cause} x{n}" if n > 1 else cause for cause, n in counted.most_common())


def _side(name: str, report: ColocateReport, causes: Sequence[str]) -> str:
    n = steps_run(report)
    rate = f"{report.http_502_seen / n:.1f}" if n else "0"
    met = f"{name} met {rate} 502s per step"
    if report.http_502_seen == 0:
        absorbed = ""
    elif report.http_502_absorbed >= report.http_502_seen:
        absorbed = ", all absorbed by retries"
    elif report.http_502_absorbed:
        absorbed = f", {report.http_502_absorbed} of {report.http_502_seen} absorbed by retries"
    elif report.retried_502:
        absorbed = f", re-sent {plural(report.retried_502, 'call')} after one and absorbed none"
    else:
        absorbed = ", and retried none of them"
    if report.resent_after_error:
        absorbed += f"; it re-sent {plural(report.resent_after_error, 'call')} after a connection reset or timeout"
        if report.way == "old":
            absorbed += ", not knowing whether the engine had acted"
    if report.engine_deaths:
        why = f" ({_causes_text(causes)})" if causes else ""
        deaths = f"; {plural(report.engine_deaths, 'engine')} died{why}"
    else:
        deaths = "; no engine died"
    if report.stopped_early or (report.failed_steps and report.restart_budget_left == 0):
        end = f", and its restart budget ({report.restart_limit}) was spent after {plural(n, 'step')}"
    elif report.failed_steps:
        end = f", and {plural(report.failed_steps, 'step')} of {n} failed ({plural(report.restarts, 'restart')})"
    else:
        end = f", and it finished {report.steps_finished} of {report.steps_planned} steps with no restart"
    return met + absorbed + deaths + end


def story(reports: Mapping[str, ColocateReport], causes: Mapping[str, Sequence[str]], titles: Mapping[str, str]) -> str:
    """One sentence per run in ``reports`` (keyed by loop, as ``causes`` and ``titles``): the 502s per step each side met,
    what killed engines, how it ended."""
    parts = []
    for kind, report in reports.items():
        title = titles.get(kind, kind)
        parts.append(_side(title[:1].upper() + title[1:], report, causes.get(kind, ())) + ".")
    return " ".join(parts)


def membership_story(report: ChurnReport, engines: int) -> str:
    """One sentence on the membership scene (``resilience.testing.churn``): who joined, who left, what it cost."""
    joined, left = plural(report.joins, "engine"), plural(report.leaves, "engine")
    lost = f"{report.requests_lost} of {plural(report.requests_sent, 'request')} lost"
    return (
        f"Membership, on {plural(engines, 'engine')} more: {joined} joined the offloaded group (paused, flushed and "
        f"released first, counted from the next onload) and {left} left (retired: nothing was sent to it again), "
        f"with {plural(report.engine_deaths, 'engine death')} and {lost}."
    )


def rates_note(reports: Mapping[str, ColocateReport], titles: Mapping[str, str]) -> str:
    """Why the ways' per-step rates and wall times differ (empty for one way): different numbers of steps run, failed
    steps short, ours' finished ones including backoff and re-run requests."""
    if len(reports) < 2:
        return ""
    ran = {kind: steps_run(r) for kind, r in reports.items()}
    parts = []
    if len(set(ran.values())) > 1:
        counts = ", ".join(
            f"{titles.get(kind, kind)} {n}" + (" (its restart budget was spent)" if r.stopped_early else "")
            for (kind, r), n in zip(reports.items(), ran.values(), strict=True)
        )
        parts.append(f"The per-step rates divide by the steps each way ran: {counts}.")
    for kind, report in reports.items():
        title, n = titles.get(kind, kind), ran[kind]
        name = title[:1].upper() + title[1:]
        if report.failed_steps and report.failed_steps == n:
            early = "" if report.phase_seconds.get("weight_sync") else " before finishing a weight sync"
            steps = "its one step" if n == 1 else f"all {n} of its steps"
            fail = f"{report.wall_s / n:.2f} s per step is the time to fail, not to train"
            parts.append(f"{name} failed {steps} at the first error{early}, so its {fail}.")
        elif report.failed_steps:
            parts.append(f"{report.failed_steps} of {name}'s {n} steps failed at their first error, which shortens its average.")
        elif n:
            retries = report.retried_502 + report.resent_after_error
            costs = (("retries' backoff", retries), ("re-run requests", report.requests_aborted_rerun))
            extras = [what for what, count in costs if count]
            paid = f", {' and '.join(extras)} included" if extras else ""
            steps = "its one step" if n == 1 else f"each of its {n} steps"
            average = " on average" if n > 1 else ""
            parts.append(f"{name} finished {steps} in {report.wall_s / n:.2f} s{average}{paid}.")
    return " ".join(p for p in parts if p)
