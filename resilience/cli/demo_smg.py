"""``cpr demo --router smg``: the colocate steps behind a real smg gateway, smg's own client vs ours (direct, via SmgFanOut).

One emulated fleet serves the three runs; each run gets fresh fault proxies
playing ``demo_plan(seed)`` and a fresh smg 1.13.0 in front of them (every
listener on 127.0.0.1), so the same seed gives every way the same faults
(``resilience.testing.smg_colocate``). Needs the ``[smg]`` extra. The table
goes to stdout, the JSON report to ``--report``; exit status 0 when both of
ours finished every step with no engine death.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from resilience.cli.common import CliError, check_output_file, plural, write_json
from resilience.cli.fleet import demo_plan
from resilience.cli.render import make_console, rich_table
from resilience.testing.colocate import ColocateConfig, ColocateReport, StepProgress

__all__ = ["run_smg_demo"]


def _progress(p: StepProgress) -> None:
    mark = "ok" if p.ok else f"failed: {p.error}"
    print(f"{p.way}: step {p.step}/{p.steps} {mark}", file=sys.stderr, flush=True)


def run_smg_demo(args: argparse.Namespace) -> int:
    """Run the three ways from parsed ``cpr demo`` arguments (``--engines``, ``--steps``, ``--seed``, ``--report``)."""
    from resilience.testing.smg import smg_available

    if not smg_available():
        raise CliError("cpr demo --router smg needs smg: pip install 'controlplane-resilience[smg]'", 2)
    from resilience.testing.emulator import EmulatedFleet, EngineConfig
    from resilience.testing.smg_colocate import PEER_WAYS, peer_rows, run_smg_colocate

    report_path = check_output_file(Path(args.report), "--report", (".json",))
    plan = demo_plan(args.seed)
    config = ColocateConfig(steps=args.steps, seed=args.seed, stragglers=0)
    t0 = time.monotonic()
    reports: dict[str, ColocateReport] = {}
    print(f"starting {plural(args.engines, 'emulated engine')}", file=sys.stderr, flush=True)
    with EmulatedFleet(args.engines, EngineConfig(health_poll_seconds=0.05)) as fleet:
        for way, _ in PEER_WAYS:
            reports[way] = run_smg_colocate(fleet, config, way, plan, progress=_progress)
    columns = ["", *(title for _, title in PEER_WAYS)]
    rows = peer_rows([reports[w] for w, _ in PEER_WAYS])
    caption = (
        f"{args.engines} engines, {args.steps} steps, seed {args.seed}, behind smg 1.13.0: cpr demo's faults between the gateway "
        "and the engines; smg's client is RL.fanout per phase and smg.rl.paused around the weight update (no retries; "
        "paused() sends continue on the way out, also after a body that released memory); restart budget 3"
    )
    console = make_console()
    console.print(rich_table("cpr demo --router smg: smg's own client vs ours", columns, rows, caption=caption))
    data = {
        "command": "demo",
        "router": "smg",
        "seed": args.seed,
        "engines": args.engines,
        "steps": args.steps,
        "fault_plan": plan.to_dict(),
        "ways": {way: reports[way].to_dict() for way, _ in PEER_WAYS},
        "table": {"columns": columns, "rows": rows},
        "wall_s": round(time.monotonic() - t0, 3),
    }
    write_json(report_path, data)
    console.print(f"report: {report_path} ({data['wall_s']:.0f} s in all)", markup=False, highlight=False)
    bad = [w for w in ("ours", "ours-smg") if reports[w].failed_steps or reports[w].engine_deaths]
    if bad:
        raise CliError(f"{', '.join(bad)} failed: {[reports[w].failures[:1] for w in bad]}")
    return 0
