"""The timeline of one colocate step across engines: a bar per engine per phase, 502s and retries marked.

The bars come from the emulator's record of each engine's control calls, the marks from each fault proxy's
``seen`` list; both in ``time.monotonic_ns()``, system-wide on Linux. An engine that died in the step lost its
record: its row shows the proxy's requests as ticks and where it died. :class:`TimelineRecorder` keeps a run's
representative step (the first failed one, else the last); :func:`write_timeline` draws them stacked, as PNG
(matplotlib, Agg) or self-contained HTML (inline SVG and the marks), by the file suffix.
"""

from __future__ import annotations

import html
import io
import re
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import requests

from resilience.cli.common import CliError, need
from resilience.cli.errors_text import clip
from resilience.cli.story import death_causes
from resilience.testing.colocate import StepProgress
from resilience.testing.emulator import EmulatedFleet
from resilience.testing.faults import FaultProxy

__all__ = ["PHASE_OF_PATH", "Bar", "Mark", "StepTimeline", "TimelineRecorder", "draw_figure", "mark_kind", "write_timeline"]

PHASE_OF_PATH: dict[str, str] = {
    "/pause_generation": "pause",
    "/flush_cache": "flush",
    "/release_memory_occupation": "release",
    "/resume_memory_occupation": "resume",
    "/continue_generation": "continue",
    "/abort_request": "abort",
    **dict.fromkeys(("/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"), "weight sync"),
}
"""Which phase each control call belongs to; consecutive calls of one phase on an engine make one bar."""

_COLORS = {"pause": "#a6cee3", "flush": "#1f78b4", "release": "#ff7f00", "resume": "#33a02c", "continue": "#b2df8a"}
_COLORS |= {"weight sync": "#cab2d6", "abort": "#bdbdbd"}
MarkKind = Literal["502", "5xx", "reset", "no answer", "retry", "died"]


@dataclass(frozen=True, slots=True)
class Bar:
    """Consecutive calls of one phase on one engine, from the first arrival to the last answer (seconds from t0)."""

    engine: int
    phase: str
    start_s: float
    end_s: float
    calls: int
    statuses: tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class Mark:
    """What the client got instead of an answer, a retry that followed it, or an engine's death (seconds from t0).

    ``502``, ``5xx`` (503/504), ``reset``, ``no answer`` (the proxy held the call: the client waits out its read
    timeout, however long the engine took), ``retry``, ``died``.
    """

    engine: int
    t_s: float
    kind: MarkKind
    path: str


@dataclass
class StepTimeline:
    """One step of one run, ready to draw."""

    way: str
    """The run's title ("old way", "ours"); a key of the JSON report."""
    step: int
    ok: bool
    error: str | None
    engines: int
    bars: list[Bar] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    ticks: list[Mark] = field(default_factory=list)
    """Requests handed on to an engine that died (its own record is gone): arrival only."""
    died: list[int] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    """What killed each engine in :attr:`died`, in the same order (from its log; "" when not logged)."""

    @property
    def title(self) -> str:
        """What happened: ``ours, step 20: ok``, or the engines' deaths with their causes first (the 502 or reset
        the client got is only their echo)."""
        if self.ok:
            return f"{self.way}, step {self.step}: ok"
        got = clip(self.error or "failed", 110)  # cut between clauses, never inside a parenthesis
        if not self.died:
            return f"{self.way}, step {self.step}: {got}"
        by_cause: dict[str, list[int]] = {}
        for i, cause in zip(self.died, [*self.causes, *[""] * len(self.died)], strict=False):
            by_cause.setdefault(cause or "cause not logged", []).append(i)
        killed = "; ".join(
            f"{cause} killed engine{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"
            for cause, ids in sorted(by_cause.items(), key=lambda item: -len(item[1]))
        )
        lines = textwrap.wrap(f"{self.way}, step {self.step}: {killed}", 150)
        return "\n".join([*lines, f"the client only saw: {got}"])

    def training_gap(self) -> tuple[float, float] | None:
        """(start, end) s of the training pause: from the last release's answer to the first resume's arrival, if both are drawn."""
        releases = [b.end_s for b in self.bars if b.phase == "release"]
        if not releases:
            return None
        start = max(releases)
        resumes = [b.start_s for b in self.bars if b.phase == "resume" and b.start_s >= start]
        return (start, min(resumes)) if resumes else None

    def segments(self) -> list[tuple[str, float, float]]:
        """The step's transitions as ``(label, start, end)`` s: the offload and onload around the training pause, then
        the weight sync from the first pause or weight-sync call after the resumes. Empty without a training pause."""
        gap = self.training_gap()
        if gap is None or not self.bars:
            return []
        first, last = min(b.start_s for b in self.bars), max(b.end_s for b in self.bars)
        after = [b.start_s for b in self.bars if b.start_s > gap[1] and b.phase in ("pause", "weight sync")]
        sync = min(after) if after else last
        out = [(self._label("offload", first, gap[0]), first, gap[0]), ("training (memory released)", gap[0], gap[1])]
        out.append((self._label("onload", gap[1], sync), gap[1], sync))
        if after:
            out.append((self._label("weight sync: paused again", sync, last), sync, last))
        return out

    def _label(self, name: str, start: float, end: float) -> str:
        """``name``, and why it took long: an engine ran its release or resume more than once, or a call got no answer."""
        runs = max(
            (
                sum(1 for b in self.bars if b.engine == i and b.phase == phase and start <= b.start_s <= end)
                for i in range(self.engines)
                for phase in ("release", "resume")
            ),
            default=0,
        )
        said = name
        if runs >= 2:
            said += f", {runs} rounds: run again after its engines' memory was reconciled"
        held = sorted({PHASE_OF_PATH.get(m.path, m.path) for m in self.marks if m.kind == "no answer" and start <= m.t_s <= end})
        if held:
            said += f" (no answer to a {' or '.join(held)}: it waits out the read timeout)"
        return said

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


class TimelineRecorder:
    """A progress callback (after :meth:`attach`) that captures the run's representative step: the first failed, else the last."""

    def __init__(self, title: str, fleet: EmulatedFleet) -> None:
        self.title = title
        self.fleet = fleet
        self.proxies: list[FaultProxy] = []
        self.captured: StepTimeline | None = None
        self._pids: list[int] = []

    def attach(self, proxies: list[FaultProxy]) -> None:
        """Remember the run's proxies and the engines' PIDs (a changed PID later means the engine died)."""
        self.proxies = proxies
        self._pids = [e.pid for e in self.fleet.engines]

    def __call__(self, p: StepProgress) -> None:
        pids = [e.pid for e in self.fleet.engines]
        engines = self.fleet.engines
        died = [i for i, (a, b) in enumerate(zip(self._pids, pids, strict=True)) if a != b or not engines[i].alive()]
        self._pids = pids
        first_failure = not p.ok and (self.captured is None or self.captured.ok)
        if first_failure or (p.step == p.steps and self.captured is None):
            if p.started_ns is not None and p.ended_ns is not None:
                self.captured = self._capture(p, died)

    def _readable(self, error: str | None) -> str | None:
        """The step's error with proxy URLs named as engines and the loop's ``step N:`` prefix dropped."""
        if error is None:
            return None
        text = re.sub(r"^step \d+: ", "", error)
        for i, proxy in enumerate(self.proxies):
            text = re.sub(re.escape(proxy.url) + r"(\S*)", rf"engine {i} \1", text)
        text = text.replace(" for url: ", " from ").replace(" )", ")").strip()
        return re.sub(r"HTTPError: (\d{3}) (?:Server|Client) Error: [^/]*? from ", r"\1 from ", text)  # "502 from engine 1 /path"

    def _capture(self, p: StepProgress, died: list[int]) -> StepTimeline:
        t_lo, t_hi = p.started_ns or 0, p.ended_ns or 0
        tl = StepTimeline(self.title, p.step, p.ok, self._readable(p.error), len(self.fleet.engines), died=died)
        calls: list[tuple[int, dict[str, Any]]] = []
        for i, engine in enumerate(self.fleet.engines):
            if i in died:
                continue
            try:
                record = engine.record()["calls"]
            except requests.RequestException:
                continue
            calls += [(i, c) for c in record if c["path"] in PHASE_OF_PATH and t_lo <= c["received_ns"] <= t_hi]
        seen = [(i, s) for i, proxy in enumerate(self.proxies) for s in proxy.seen if t_lo <= s.t_ns <= t_hi and s.path in PHASE_OF_PATH]
        starts = [c["received_ns"] for _, c in calls] + [s.t_ns for _, s in seen]
        t0 = min(starts) if starts else t_lo

        def sec(ns: int) -> float:
            return (ns - t0) / 1e9

        for i in range(tl.engines):
            mine = sorted((c for e, c in calls if e == i), key=lambda c: c["received_ns"])
            run: list[dict[str, Any]] = []
            for call in [*mine, None]:
                if run and (call is None or PHASE_OF_PATH[call["path"]] != PHASE_OF_PATH[run[0]["path"]]):
                    end, phase = max(c["answered_ns"] or c["received_ns"] for c in run), PHASE_OF_PATH[run[0]["path"]]
                    tl.bars.append(Bar(i, phase, sec(run[0]["received_ns"]), sec(end), len(run), tuple(c["status"] for c in run)))
                    run = []
                if call is not None:
                    run.append(call)
        failed_before: set[tuple[int, str]] = set()
        last_handed_on: dict[int, float] = {}
        for i, s in sorted(seen, key=lambda item: item[1].t_ns):
            key = (i, s.path)
            if key in failed_before:
                tl.marks.append(Mark(i, sec(s.t_ns), "retry", s.path))
                failed_before.discard(key)
            kind = mark_kind(s.client_status, s.fault)
            if kind is not None:
                tl.marks.append(Mark(i, sec(s.t_ns), kind, s.path))
                failed_before.add(key)
            if i in died and s.fault is None:
                tl.ticks.append(Mark(i, sec(s.t_ns), "died", s.path))
                last_handed_on[i] = sec(s.t_ns)
        for i in died:
            tl.marks.append(Mark(i, last_handed_on.get(i, sec(t_hi)), "died", ""))
            causes = death_causes(self.fleet.engines[i].log())
            tl.causes.append(causes[-1] if causes else "")  # the engine restarted since: its latest death is this one
        return tl


def mark_kind(client_status: int | None, fault: str | None) -> MarkKind | None:
    """How a request the proxy saw is marked: what the client got instead of a good answer (None: nothing to mark)."""
    if client_status == 502:
        return "502"
    if client_status in (503, 504) and fault is not None:
        return "5xx"
    if fault in ("reset_before", "reset_after", "drop_after"):
        return "reset"
    if fault in ("hang_after", "hang"):
        return "no answer"
    return None


# -- drawing ------------------------------------------------------------------------------------


def draw_figure(timelines: Sequence[StepTimeline]) -> Any:
    """The matplotlib figure of ``timelines`` stacked on one time axis (Agg backend); the caller closes it."""
    matplotlib = need("matplotlib", "cli", "--timeline")
    matplotlib.use("Agg")
    plt = need("matplotlib.pyplot", "cli", "--timeline")
    patches = need("matplotlib.patches", "cli", "--timeline")
    lines = need("matplotlib.lines", "cli", "--timeline")
    heights = [max(2.2, 0.42 * (t.engines + (1.3 if t.segments() else 0)) + 1.3) for t in timelines]
    ratios = {"height_ratios": heights}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, sum(heights)), squeeze=False, sharex=True, gridspec_kw=ratios)
    right = max([b.end_s for t in timelines for b in t.bars] + [m.t_s for t in timelines for m in t.marks + t.ticks] + [0.01])
    for ax, tl in zip(axes[:, 0], timelines, strict=True):
        gap = tl.training_gap()
        if gap is not None:  # the training pause: engines released, the trainer has the GPU
            ax.axvspan(gap[0], gap[1], color="#fff3bf", zorder=0)
        segments = tl.segments()
        lane = tl.engines - 0.25  # rows below the engines naming the step's transitions, never over a bar
        for k, (label, start, end) in enumerate(segments):
            y = lane + (0.5 if k % 2 else 0.0)  # neighbours alternate between two heights: narrow ones do not collide
            color = "#7a6000" if label.startswith("training") else "#444444"
            ax.plot([start, end], [y, y], color=color, linewidth=1.2, solid_capstyle="butt")
            ax.text((start + end) / 2, y + 0.06, label, ha="center", va="top", fontsize=7.5, color=color)
        for bar in tl.bars:
            failed = any(s is None or s >= 400 for s in bar.statuses)
            ax.broken_barh(
                [(bar.start_s, max(bar.end_s - bar.start_s, 0.004))],
                (bar.engine - 0.35, 0.7),
                facecolors=_COLORS.get(bar.phase, "#bdbdbd"),
                edgecolors="#b30000" if failed else "#555555",
                linewidth=1.4 if failed else 0.5,
            )
        for tick in tl.ticks:  # requests handed on to an engine that then died: arrival only, coloured by phase
            color = _COLORS.get(PHASE_OF_PATH.get(tick.path, ""), "#555555")
            ax.plot([tick.t_s, tick.t_s], [tick.engine - 0.32, tick.engine + 0.32], color=color, linewidth=3, solid_capstyle="butt")
        style = {
            "502": {"marker": "x", "color": "#d62728", "s": 60, "linewidths": 2},
            "5xx": {"marker": "x", "color": "#ff7f0e", "s": 60, "linewidths": 2},
            "no answer": {"marker": "o", "facecolors": "none", "edgecolors": "#6a3d9a", "s": 70, "linewidths": 1.6},
            "reset": {"marker": "|", "color": "#000000", "s": 120, "linewidths": 2},
            "retry": {"marker": ">", "color": "#2ca02c", "s": 40},
            "died": {"marker": "X", "color": "#7f0000", "s": 160},
        }
        for kind, kw in style.items():
            pts = [m for m in tl.marks if m.kind == kind]
            if pts:
                ax.scatter([m.t_s for m in pts], [m.engine for m in pts], zorder=3, **kw)
        for m in tl.marks:
            if m.kind == "died":
                ax.annotate("died", (m.t_s, m.engine), xytext=(6, -4), textcoords="offset points", color="#7f0000", fontsize=8)
        ax.set_yticks(range(tl.engines))
        ax.set_yticklabels([f"engine {i}" for i in range(tl.engines)])
        ax.set_ylim(tl.engines - 0.5 + (1.3 if segments else 0.0), -0.5)
        ax.set_xlim(-0.03 * right, 1.06 * right)  # one time axis for every panel
        ax.tick_params(axis="x", labelbottom=True)
        ax.set_title(tl.title, loc="left", fontsize=10, color="#222222" if tl.ok else "#b30000")
        ax.grid(axis="x", color="#e0e0e0", linewidth=0.6)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlabel("seconds since the step's first control call")
    used = {b.phase for t in timelines for b in t.bars} | {PHASE_OF_PATH.get(m.path, "") for t in timelines for m in t.ticks}
    phases = [p for p in _COLORS if p in used]
    handles = [patches.Patch(facecolor=_COLORS[p], edgecolor="#555555", label=p) for p in phases]
    if any(t.training_gap() for t in timelines):
        handles.append(patches.Patch(facecolor="#fff3bf", label="training (memory released)"))
    handles += [
        lines.Line2D([], [], marker="x", color="#d62728", linestyle="", markeredgewidth=2, label="502 to the client"),
        lines.Line2D([], [], marker="x", color="#ff7f0e", linestyle="", markeredgewidth=2, label="503/504 to the client"),
        lines.Line2D(
            [], [], marker="o", markerfacecolor="none", color="#6a3d9a", linestyle="", label="no answer: the client waits out its timeout"
        ),
        lines.Line2D([], [], marker="|", color="#000000", linestyle="", markersize=10, label="connection reset"),
        lines.Line2D([], [], marker=">", color="#2ca02c", linestyle="", label="retry after one of these"),
        lines.Line2D([], [], marker="X", color="#7f0000", linestyle="", markersize=9, label="engine died"),
        patches.Patch(facecolor="white", edgecolor="#b30000", linewidth=1.4, label="phase with an error answer"),
        lines.Line2D([], [], color="#777777", linewidth=3, label="call to an engine that died (arrival)"),
    ]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 7), fontsize=8, frameon=False, bbox_to_anchor=(0.5, 1.0))
    fig.suptitle("Offload / onload / weight sync across engines", x=0.01, ha="left", y=1.04, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def _html(timelines: Sequence[StepTimeline], svg: str) -> str:
    rows = []
    for tl in timelines:
        for m in sorted(tl.marks, key=lambda m: (m.t_s, m.engine)):
            rows.append(
                f"<tr><td>{html.escape(tl.way)}</td><td>{tl.step}</td><td>{m.engine}</td><td>{m.t_s:.3f}</td>"
                f"<td>{html.escape(m.kind)}</td><td>{html.escape(m.path)}</td></tr>"
            )
    table = "\n".join(rows) or '<tr><td colspan="6">no error answers, resets, held calls, retries or deaths in these steps</td></tr>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>cpr timeline</title>
<style>body{{font-family:system-ui,sans-serif;margin:1.5em;color:#222}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}} th{{background:#f3f3f3}} svg{{max-width:100%;height:auto}}</style>
</head><body>
<h1>Offload / onload / weight sync across engines</h1>
<p>Each bar is one phase on one engine, from the first call's arrival to the last answer (server-side record);
marks are what the clients got through the fault proxy.</p>
{svg}
<h2>Marks</h2>
<table><tr><th>way</th><th>step</th><th>engine</th><th>t (s)</th><th>mark</th><th>path</th></tr>
{table}
</table></body></html>
"""


def write_timeline(path: Path, timelines: Sequence[StepTimeline]) -> None:
    """Draw ``timelines`` (at least one) stacked into ``path``: ``.png`` (matplotlib) or ``.html``/``.htm`` (inline SVG)."""
    fig = draw_figure(timelines)
    plt = need("matplotlib.pyplot", "cli", "--timeline")
    try:
        if path.suffix.lower() == ".png":
            fig.savefig(path, dpi=110, bbox_inches="tight")
        else:
            buf = io.StringIO()
            fig.savefig(buf, format="svg", bbox_inches="tight")
            svg = buf.getvalue()
            svg = svg[svg.index("<svg") :]
            path.write_text(_html(timelines, svg), encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
