"""Print the markdown section of ``benchmarks/NOTES.md`` for a ``cpr soak`` run by hand, from its JSON reports.

The 1000-step soak takes about 30-40 minutes here, too long for ``run_all.py``, so it runs on demand and its
figures are kept in ``NOTES.md`` (BENCHMARKS.md points there):

    .venv/bin/cpr soak --engines 8 --steps 1000 --seed 3 --report ours.json
    .venv/bin/cpr soak --engines 8 --steps 1000 --seed 3 --way old --report old.json
    .venv/bin/python benchmarks/soak_notes.py ours.json old.json [--date YYYY-MM-DD] [--commit REV]

``ours.json`` is the resilient loop's report; ``old.json`` (optional) the naive sequence's on the same seed.
The section ends with the commands that rerun it and the commit they ran on (``--commit``; default: this
checkout's ``HEAD``), so a stranger can repeat the run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def _load(path: str) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"soak_notes: cannot read the soak report {path!r}: {exc}") from None
    if data.get("command") != "soak" or len(data.get("ways", {})) != 1:
        raise SystemExit(f"soak_notes: {path!r} is not a `cpr soak` report (no 'command': 'soak' with one way)")
    return data


def _mem(v: dict[str, Any]) -> str:
    if v.get("first_mb") is None:
        return "-"
    return f"{v['first_mb']:.1f} -> {v['last_mb']:.1f} MB ({v['growth_pct']:+.1f} %, {'flat' if v['flat'] else 'growing'})"


def _p50(r: dict[str, Any], phase: str) -> str:
    p = r.get("phase_latency_s", {}).get(phase, {}).get("p50")
    return "-" if p is None else f"{p:.2f}"


def _engine_memory_rows(ways: list[tuple[str, dict[str, Any], dict[str, Any]]], anon_judged: bool) -> list[tuple[str, list[str]]]:
    """The engines' memory rows: the anonymous PSS (judged) and the whole PSS (not judged: its shared-library pages are
    split with unrelated processes); a report without the anonymous PSS has one row, the whole PSS, which it judged."""
    whole = [_mem(d["memory"]["engines"]) for _, d, _ in ways]
    if not anon_judged:
        return [("PSS, engines + zygote (after warm-up -> last 10 %; judged)", whole)]
    anon = [_mem(d["memory"].get("engines_anon", {})) for _, d, _ in ways]
    return [
        ("anonymous PSS, engines + zygote (after warm-up -> last 10 %; judged)", anon),
        ("PSS with shared-library pages (same windows; not judged)", whole),
    ]


def _commands(ours: dict[str, Any], old: dict[str, Any] | None, commit: str | None) -> str:
    """The line that says how to rerun the section: each way's ``cpr soak`` command, the report script, the commit."""
    args = f"--engines {ours['engines']} --steps {ours['steps']} --seed {ours['seed']}"
    if ours.get("restart_every") not in (None, 50):
        args += f" --restart-every {ours['restart_every']}"
    if ours.get("fault_plan_file"):
        args += f" --fault-plan {ours['fault_plan_file']}"
    cmds = [f"`.venv/bin/cpr soak {args} --report ours.json`"]
    if old is not None:
        cmds.append(f"`.venv/bin/cpr soak {args} --way old --report old.json`")
    script = "`.venv/bin/python benchmarks/soak_notes.py ours.json" + (" old.json`" if old is not None else "`")
    at = f", at commit `{commit}`" if commit else ""
    return f"- Commands: {' and '.join(cmds)}{at}; {script} printed the table."


def _head_commit() -> str | None:
    """This checkout's ``HEAD``, abbreviated, or None outside a git checkout."""
    try:
        argv = ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def section(ours: dict[str, Any], old: dict[str, Any] | None, date: str, commit: str | None = None) -> str:
    """The section: a heading with the command, one table with a column per way, the verdict and how to rerun it."""
    reports = [("ours", ours)] + ([("old way", old)] if old is not None else [])
    ways = [(name, d, next(iter(d["ways"].values()))) for name, d in reports]
    minutes = f"{ours['wall_s'] / 60:.0f}"
    head = (
        f"## Soak with controller kills (`cpr soak --engines {ours['engines']} --steps {ours['steps']} --seed {ours['seed']}`, "
        f"{date}: about {minutes} minutes)\n\n"
        f"The default soak plan (`soak_plan`: the demo's faults plus 502/504 after the engine applied a release, resume or "
        f"continue), the controller killed inside a seeded phase every {ours.get('restart_every')} steps and a new one started "
        "on its journal as it was at the kill; reconciles through the emulator's memory probe only. The old way: "
        f"`--way old` on the same seed (it stops once its restart budget is spent).\n"
    )
    anon_judged = "engines_anon" in ours.get("memory", {})  # a report from before the anonymous PSS judged the whole PSS
    rows: list[tuple[str, list[str]]] = [
        ("steps finished / failed", [f"{r['steps_finished']} / {r['failed_steps']}" for _, _, r in ways]),
        ("engine deaths", [str(r["engine_deaths"]) for _, _, r in ways]),
        ("requests lost", [str(r["requests_lost"]) for _, _, r in ways]),
        ("global restarts (budget left)", [f"{r['restarts']} ({r['restart_budget_left']} of {r['restart_limit']})" for _, _, r in ways]),
        ("controller restarts (killed mid-phase)", [f"{r['controller_restarts']} ({r.get('controller_kills', 0)})" for _, _, r in ways]),
        (
            "barrier reconciles from the probe / restarts needing none",
            [f"{r.get('reconciles_probe', 0)} / {r.get('restarts_clean', 0)}" for _, _, r in ways],
        ),
        ("releases/resumes settled by the clients' probe", [str(r.get("probe_verdicts", 0)) for _, _, r in ways]),
        ("502s seen / absorbed", [f"{r['http_502_seen']:,} / {r['http_502_absorbed']:,}" for _, _, r in ways]),
        ("faults after the engine acted", [f"{r['ambiguous_faults_seen']:,}" for _, _, r in ways]),
        *_engine_memory_rows(ways, anon_judged),
        ("RSS, this process (same windows)", [_mem(d["memory"]["self"]) for _, d, _ in ways]),
        (
            "offload / onload / weight sync p50 (s)",
            [" / ".join(_p50(r, p) for p in ("offload", "onload", "weight_sync")) for _, _, r in ways],
        ),
        ("wall time", [f"{d['wall_s'] / 60:.1f} min" for _, d, _ in ways]),
    ]
    lines = ["| measure | " + " | ".join(n for n, _, _ in ways) + " |", "|---|" + "---:|" * len(ways)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    verdict = ours.get("verdict", {})
    missed = [k.replace("_", " ") for k, ok in verdict.items() if ok is False]
    flat = "the engines' anonymous PSS flat" if anon_judged else "engine PSS flat"
    met = f"met (zero deaths, zero failed steps, zero requests lost, {flat})."
    tail = "\nEnd criteria (ours): " + (met if not missed else "missed: " + ", ".join(missed) + ".")
    return head + "\n" + "\n".join(lines) + "\n" + tail + "\n\n" + _commands(ours, old, commit) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ours", help="the resilient loop's `cpr soak --report` JSON")
    parser.add_argument("old", nargs="?", help="the naive sequence's (`--way old`) on the same seed")
    parser.add_argument("--date", default=str(datetime.date.today()), help="the run's date (default: today)")
    parser.add_argument("--commit", default=None, help="the commit the soak ran on (default: this checkout's HEAD)")
    args = parser.parse_args(argv)
    commit = args.commit if args.commit is not None else _head_commit()
    sys.stdout.write(section(_load(args.ours), _load(args.old) if args.old else None, args.date, commit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
