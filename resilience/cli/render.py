"""How ``cpr`` shows things: side-by-side tables (rich, imported lazily), progress, one-line policy descriptions.

:func:`comparison_rows` builds the table's rows once, for the rich table and the JSON report alike.
"""

from __future__ import annotations

import errno
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from resilience.cli.common import need, plural
from resilience.cli.errors_text import short_error
from resilience.cli.story import per_step, steps_run
from resilience.policy import EndpointPolicy, PolicyTable

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID
    from rich.table import Table

    from resilience.testing.colocate import StepProgress
    from resilience.testing.lab import ColocateReport

__all__ = [
    "PHASES",
    "POLICY_COLUMNS",
    "RunProgress",
    "comparison_rows",
    "describe_policy",
    "make_console",
    "policy_rows",
    "rich_table",
    "seconds",
]

PHASES: tuple[tuple[str, str], ...] = (("offload", "offload"), ("onload", "onload"), ("weight_sync", "weight sync"))
"""(report key, label) of the colocate phases whose latency the table shows."""

_NONE = "-"


def make_console(*, stderr: bool = False) -> Console:
    """A rich Console, 160 columns wide and colourless on a pipe or file; a closed pipe raises BrokenPipeError out of
    the print (``main`` ends quietly with 141) instead of rich's ``SystemExit(1)``."""
    need("rich.console", "cli", "this command")
    from rich.console import Console as RichConsole

    class PipeConsole(RichConsole):
        def on_broken_pipe(self) -> None:
            self.quiet = True  # nothing more is written through this console
            raise BrokenPipeError(errno.EPIPE, "the reader of this output went away")

    stream = sys.stderr if stderr else sys.stdout
    terminal = stream.isatty()
    return PipeConsole(file=stream, width=None if terminal else 160, no_color=not terminal, highlight=False, soft_wrap=False)


def seconds(value: float | None, digits: int = 3) -> str:
    """A duration in seconds, or ``-`` when there is none."""
    return _NONE if value is None else f"{value:.{digits}f}"


def _phase_cell(report: ColocateReport, phase: str) -> str:
    p50, p99 = report.percentile(phase, 0.5), report.percentile(phase, 0.99)
    return _NONE if p50 is None else f"{seconds(p50)} / {seconds(p99)}"


def _outcome(report: ColocateReport) -> str:
    run, planned = steps_run(report), report.steps_planned
    spent = report.restart_budget_left == 0 and report.failed_steps > 0
    if report.stopped_early:
        return f"stopped at step {run} of {planned}: restart budget spent"
    if report.failed_steps == 0:
        return "its one step finished" if planned == 1 else f"all {planned} steps finished"
    ran = "its one step failed" if planned == 1 else f"ran all {planned} steps, {report.failed_steps} failed"
    return ran + ("; restart budget spent" if spent else "")


def _controller_restarts(report: ColocateReport) -> str:
    """How the controller that replaced one killed while training started (fresh, or from the journal), and what that cost."""
    if not report.controller_restarts:
        return _NONE
    how = "fresh" if report.way == "old" else "from the journal"
    times = "" if report.controller_restarts == 1 else f" ({report.controller_restarts} restarts)"
    return f"{how}: {plural(report.controller_restart_deaths, 'engine')} died{times}"


_ROWS: tuple[tuple[str, Callable[[ColocateReport], str]], ...] = (
    # one row per line: (label, cell of one run); the JSON report stores the same strings.
    # Its "way" key is the loop kind: "old" = baseline, "ours" = resilient.
    ("steps run (the per-step rates below divide by these)", lambda r: f"{steps_run(r)} of {r.steps_planned}"),
    ("steps finished", lambda r: f"{r.steps_finished} of {r.steps_planned}"),
    ("failed steps", lambda r: f"{r.failed_steps} of {steps_run(r)} run"),
    ("restarts a controller would have triggered", lambda r: str(r.restarts)),
    ("controller killed while training; its successor", _controller_restarts),
    ("restart budget left", lambda r: f"{r.restart_budget_left} of {r.restart_limit}"),
    ("engine deaths", lambda r: per_step(r.engine_deaths, r)),
    ("502s seen", lambda r: per_step(r.http_502_seen, r)),
    ("502s absorbed by retries", lambda r: per_step(r.http_502_absorbed, r)),
    ("calls re-sent after a 502", lambda r: per_step(r.retried_502, r)),
    ("calls re-sent after a reset or timeout", lambda r: per_step(r.resent_after_error, r)),
    ("ambiguous faults (reset/timeout after the engine acted)", lambda r: per_step(r.ambiguous_faults_seen, r)),
    ("engines quarantined (memory state unknown)", lambda r: str(r.engines_quarantined) if r.way == "ours" else _NONE),
    ("engines reconciled (truth: emulator memory probe)", lambda r: str(r.engines_reconciled) if r.way == "ours" else _NONE),
    ("requests aborted/retracted and re-run", lambda r: per_step(r.requests_aborted_rerun, r)),
    ("requests lost", lambda r: per_step(r.requests_lost, r)),
    *((f"{label} p50 / p99 (s)", lambda r, key=key: _phase_cell(r, key)) for key, label in PHASES),
    (
        "wall time (s): total (per step run)",
        lambda r: f"{r.wall_s:.1f} ({r.wall_s / steps_run(r):.2f}/step)" if steps_run(r) else f"{r.wall_s:.1f}",
    ),
    ("outcome", _outcome),
)


def comparison_rows(reports: Sequence[ColocateReport]) -> list[list[str]]:
    """The table's rows: ``[label, value per report...]``; the JSON report stores exactly these."""
    return [[label, *(cell(r) for r in reports)] for label, cell in _ROWS]


def rich_table(
    title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]], *, caption: str | None = None, wrap: Sequence[int] = ()
) -> Table:
    """A rich Table: left-aligned labels first, right-aligned values; the columns in ``wrap`` (left-aligned) take the room
    left. ``title``: above the table (None = none). Cells wrap rather than being cut."""
    table_mod = need("rich.table", "cli", "this command")
    table: Table = table_mod.Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for i, name in enumerate(columns):
        wraps = i in wrap or (i - len(columns)) in wrap
        table.add_column(name, justify="left" if i == 0 or wraps else "right", overflow="fold", ratio=1 if wraps else None, no_wrap=i == 0)
    for row in rows:
        table.add_row(*row)
    return table


# -- policies -------------------------------------------------------------------------------


def _num(value: float | None) -> str:
    return "none" if value is None else f"{value:g}"


def describe_policy(policy: EndpointPolicy) -> str:
    """One line: idempotency, attempts and on what, backoff, timeouts (``cpr probe`` and ``cpr policies``)."""
    retry = policy.retry
    statuses = "/".join(str(s) for s in sorted(retry.statuses)) or "no status"
    if retry.max_attempts == 1:
        attempts = "never retried"
    elif policy.idempotent:
        attempts = f"{retry.max_attempts} attempts on {statuses} and transport errors"
    elif policy.retry_statuses_if_not_idempotent:
        attempts = f"{retry.max_attempts} attempts on {statuses} and failures before sending; never re-sent after sending"
    else:
        attempts = f"{retry.max_attempts} attempts on failures before sending only"
    kind = "idempotent" if policy.idempotent else "not idempotent"
    timeouts = f"{_num(policy.attempt_timeout_s)} s/attempt, {_num(policy.deadline_s)} s deadline"
    return f"{kind}; {attempts}; backoff {_num(retry.base_s)}-{_num(retry.cap_s)} s; {timeouts}"


def policy_rows(table: PolicyTable) -> list[list[str]]:
    """Rows of ``cpr policies``: one per table entry, in the table's order."""
    rows = []
    for key, policy in table:
        retry = policy.retry
        notes = []
        if not policy.idempotent and policy.retry_statuses_if_not_idempotent:
            notes.append("gateway statuses retried although not idempotent")
        if not policy.idempotent:
            notes.append("ambiguous: raise" if policy.on_ambiguous == "raise" else "ambiguous: probe")
        if policy.raise_on_exhausted:
            notes.append("raises when exhausted")
        if policy.accept_statuses:
            notes.append("accepts " + "/".join(str(s) for s in sorted(policy.accept_statuses)))
        unnamed = [name for name in ("attempt_timeout_s", "deadline_s") if not policy.named(name)]
        if unnamed:
            notes.append(f"{' and '.join(unnamed)} not named: the caller's timeout wins")
        rows.append(
            [
                key,
                "yes" if policy.idempotent else "no",
                str(retry.max_attempts),
                "/".join(str(s) for s in sorted(retry.statuses)) or _NONE,
                f"{_num(retry.base_s)}-{_num(retry.cap_s)}",
                _num(policy.attempt_timeout_s),
                _num(policy.deadline_s),
                "; ".join(notes) or _NONE,
            ]
        )
    return rows


POLICY_COLUMNS: tuple[str, ...] = ("endpoint", "idempotent", "attempts", "on statuses", "backoff s", "attempt s", "deadline s", "notes")
"""Columns of :func:`policy_rows`."""


# -- progress -------------------------------------------------------------------------------


class RunProgress:
    """Progress of a long command on stderr, a context manager: a live rich display on a terminal, plain lines otherwise."""

    def __init__(self) -> None:
        self.console = make_console(stderr=True)
        self.live = self.console.is_terminal
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._notes: dict[str, str] = {}

    def __enter__(self) -> RunProgress:
        if self.live:
            progress_mod = need("rich.progress", "cli", "this command")
            self._progress = progress_mod.Progress(
                progress_mod.SpinnerColumn(),
                progress_mod.TextColumn("[bold]{task.description}"),
                progress_mod.BarColumn(),
                progress_mod.MofNCompleteColumn(),
                progress_mod.TextColumn("{task.fields[info]}"),
                progress_mod.TimeElapsedColumn(),
                console=self.console,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def print(self, text: str) -> None:
        """A line above the live display (or on stderr)."""
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def counter(self, description: str, total: int) -> Callable[[int], None]:
        """A bar of ``total`` items (engines starting); the returned function marks item ``i`` done, in any order."""
        t0 = time.monotonic()
        done: set[int] = set()
        task_id = self._progress.add_task(description, total=total, info="") if self._progress is not None else None
        if self._progress is None:
            self.print(f"{description}: 0 of {total} ...")

        def item_done(i: int) -> None:
            done.add(i)
            if self._progress is not None and task_id is not None:
                self._progress.update(task_id, completed=len(done), info=f"engine {i} ready")
            else:
                self.print(f"{description}: {len(done)} of {total} (engine {i} ready, {time.monotonic() - t0:.1f} s)")

        return item_done

    def note(self, name: str, text: str) -> None:
        """What the run ``name`` is waiting for now (a slow step); shown beside its bar, or printed once per change."""
        if self._notes.get(name) == text:
            return
        self._notes[name] = text
        task_id = self._tasks.get(name)
        if self._progress is not None and task_id is not None:
            self._progress.update(task_id, info=text)
        elif text:
            self.print(f"{name}: {text}")

    def run_progress(self, name: str, steps: int, extra: Callable[[], str], labels: Mapping[str, str]) -> Callable[[StepProgress], None]:
        """A callback for ``run_colocate(progress=...)`` showing step, restarts, deaths and ``extra()``; a failed step's
        error names engines by ``labels`` (``{base URL: "engine i"}``, read at each step)."""
        task_id: TaskID | None = None
        if self._progress is not None:
            task_id = self._progress.add_task(name, total=steps, info="")
            self._tasks[name] = task_id

        def on_step(p: StepProgress) -> None:
            self._notes.pop(name, None)
            info = f"restarts {p.restarts}, deaths {p.deaths}, {extra()}"
            if self._progress is not None and task_id is not None:
                self._progress.update(task_id, completed=p.step, info=info)
                if not p.ok:
                    self.print(f"{name}: step {p.step} failed: {short_error(p.error, labels)}")
            else:
                verdict = "ok" if p.ok else f"FAILED: {short_error(p.error, labels)}"
                self.print(f"{name}: step {p.step}/{p.steps} {verdict} ({info})")

        return on_step

    def run_ended(self, name: str, report: ColocateReport) -> None:
        """Say how a run ended (a stopped run's bar stays short of its total), numbering steps from 1 as the bar does."""
        self.print(f"{name}: {_outcome(report)} ({report.wall_s:.1f} s)")
