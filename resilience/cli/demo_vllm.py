"""``cpr demo --engine vllm``: colocated RL steps on emulated vLLM 0.33.0 engines, SkyRL's sequence against ours.

One fleet of emulated vLLM engines (dev mode, sleep mode, an NCCL weight-transfer
config) serves both runs; each run goes through fresh fault proxies playing
``vllm_demo_plan(seed)`` (``FaultPlan.vllm_like``: 502s on every control call of
the RL transaction, resets and hangs after the engine acted on sleep, wake and the
weight calls, slow wakes; and a reset after each engine's first sleep), so the same
seed gives both runs the same faults. The old way is SkyRL's colocated sequence
(sleep level 2, wake weights, broadcast, wake kv_cache; a bare ``asyncio.gather``
per phase, no retry, no timeout); ours is the barrier with the vLLM rules
(``resilience.testing.colocate_vllm``). Ours runs first; the table shows the old way
first, with the same rows as ``cpr demo``'s and the completions that came back 200
from garbage weights. Exit status 0 when ours finished every step with no engine death.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from resilience.cli.common import CliError, check_output_file, plural, write_json
from resilience.cli.fleet import DEMO_AMBIGUOUS
from resilience.cli.render import comparison_rows, make_console, rich_table
from resilience.cli.story import per_step
from resilience.testing.colocate import BASELINE, RESILIENT, ColocateConfig, ColocateReport, StepProgress
from resilience.testing.emulator.vllm import VLLMEngineConfig
from resilience.testing.faults import FaultPlan, FaultProxy, FaultRule

__all__ = ["VLLM_DEMO_ENGINE", "VLLM_LOOPS", "run_vllm_demo", "vllm_demo_plan"]

VLLM_LOOPS = ((BASELINE, "old way (SkyRL)"), (RESILIENT, "ours"))
"""The two loops in table order, with their column titles."""
VLLM_DEMO_ENGINE = VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, weight_transfer_backend="nccl", token_rate=400.0)
"""The demo's and the soak's vLLM engines: dev mode (the control routes), sleep mode (slept memory is gone), NCCL weight transfer."""


def vllm_demo_plan(seed: int) -> FaultPlan:
    """``FaultPlan.vllm_like(seed, ambiguous=DEMO_AMBIGUOUS)``, and the first ``/sleep`` of every engine reset once sent
    (the engine sleeps; the client sees no answer), so every run meets the ambiguous case at its first offload."""
    base = FaultPlan.vllm_like(seed, ambiguous=DEMO_AMBIGUOUS)
    first = FaultRule("/sleep", "drop_after", calls=frozenset({1}))
    return FaultPlan(seed=base.seed, rules=(first, *base.rules), max_streak=base.max_streak)


def _progress(p: StepProgress) -> None:
    mark = "ok" if p.ok else f"failed: {p.error}"
    print(f"{p.way}: step {p.step}/{p.steps} {mark}", file=sys.stderr, flush=True)


def run_vllm_demo(args: argparse.Namespace) -> int:
    """Run both ways from parsed ``cpr demo`` arguments (``--engines``, ``--steps``, ``--seed``, ``--report``)."""
    from resilience.testing.colocate_vllm import OLD_WAY_CAP_S, SKYRL_SLEEP_LEVEL, run_colocate_vllm
    from resilience.testing.emulator import EmulatedFleet

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
                reports[kind] = run_colocate_vllm(fleet, config, kind, progress=_progress, proxies=proxies)
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
    console = make_console()
    console.print(rich_table("cpr demo --engine vllm: SkyRL's sequence and ours", columns, rows, caption=caption))
    data = {
        "command": "demo",
        "engine": "vllm",
        "seed": args.seed,
        "engines": args.engines,
        "steps": args.steps,
        "fault_plan": plan.to_dict(),
        "ways": {kind: reports[kind].to_dict() for kind, _ in VLLM_LOOPS},
        "table": {"columns": columns, "rows": rows},
        "wall_s": round(time.monotonic() - t0, 3),
    }
    write_json(report_path, data)
    console.print(f"report: {report_path} ({data['wall_s']:.0f} s in all)", markup=False, highlight=False)
    ours = reports[RESILIENT]
    if ours.failed_steps or ours.engine_deaths:
        failed, deaths = plural(ours.failed_steps, "step"), plural(ours.engine_deaths, "engine death")
        raise CliError(f"ours failed {failed} with {deaths}: {ours.failures[:1]}")
    return 0
