"""The colocate sequence behind a real smg gateway: smg's own client vs our orchestrator (direct, and through SmgFanOut).

Run: ``.venv/bin/python benchmarks/bench_smg_peer.py [--engines 4] [--steps 10] [--seed 1] [--ways smg,ours,ours-smg]``

One emulated fleet; each way gets fresh fault proxies playing ``demo_plan(seed)`` (``cpr demo``'s plan: 502s and
resets on every per-step control call, resets after the engine acted on releases, resumes and continues) and a fresh
smg 1.13.0 in front of them (``run_colocate(..., route="smg")``: ``resilience.testing.lab_smg``). A markdown section
(heading, command, table of steps finished, failed steps, engine deaths, restarts, 502s injected and absorbed, wall
seconds) goes to stdout, for ``run_all.py``; progress to stderr.
"""

from __future__ import annotations

import argparse
import sys

from resilience.cli.fleet import demo_plan
from resilience.testing.colocate import ColocateConfig, StepProgress, run_colocate
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.lab_smg import PEER_WAYS, peer_rows, ways


def _progress(p: StepProgress) -> None:
    mark = "ok" if p.ok else f"FAILED ({p.error})"
    print(f"{p.way}: step {p.step}/{p.steps} {mark}; restarts {p.restarts}, deaths {p.deaths}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=4, help="emulated engines (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="steps per way (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="fault plan seed (default: %(default)s)")
    parser.add_argument("--ways", default=",".join(w for w, _ in PEER_WAYS), help="comma-separated ways (default: all)")
    args = parser.parse_args(argv)
    if args.engines < 1 or args.steps < 1:
        parser.error("--engines and --steps must be >= 1")
    try:
        chosen = ways([w for w in args.ways.split(",") if w])
    except ValueError as exc:
        parser.error(f"--ways: {exc}")
    plan = demo_plan(args.seed)
    config = ColocateConfig(steps=args.steps, seed=args.seed, stragglers=0)
    reports = {}
    with EmulatedFleet(args.engines, EngineConfig(health_poll_seconds=0.05)) as fleet:
        for way in chosen:
            reports[way] = run_colocate(fleet, config, way, route="smg", plan=plan, progress=_progress)
    titles = dict(PEER_WAYS)
    print("## The colocate sequence behind smg: smg's own client vs ours (`benchmarks/bench_smg_peer.py`)\n")
    print(f"`.venv/bin/python benchmarks/bench_smg_peer.py --engines {args.engines} --steps {args.steps} --seed {args.seed}`: each way")
    print("drives the same steps (rollout through the gateway, offload, onload, weight sync) through fresh fault proxies playing")
    print("`cpr demo`'s plan and a fresh smg 1.13.0 in front of them; restart budget 3. smg's client: `RL.fanout` per phase,")
    print("`smg.rl.paused` around the weight update (no retries; `paused()` sends continue on the way out whatever the body did).")
    print("Ours direct: `SGLangClient` + `Orchestrator` to the engines; ours via SmgFanOut: the `Orchestrator`, each phase one")
    print("`/v1/rl` fan-out through the gateway.\n")
    print("| | " + " | ".join(titles[w] for w in chosen) + " |")
    print("|---|" + "---:|" * len(chosen))
    for row in peer_rows([reports[w] for w in chosen]):
        print("| " + " | ".join(row) + " |")
    first = {w: reports[w].failures[0] for w in chosen if reports[w].failures}
    if first:
        print("\nFirst failure per way:\n")
        for way, failure in first.items():
            print(f"- {titles[way]}: `{failure[:200]}`")
    print("\nsmg's client fails a step at the first fault it meets (it has no retries), before any call it could repeat, so its")
    print("engines do not die here: each failed step is a restart, until the budget is spent. What can kill an engine is")
    print("`paused()` itself: it sends `continue_generation` on the way out whatever its body did, and a body that released memory")
    print("leaves an engine serving with no KV cache, which dies at its next prefill (`tests/smg/test_smg_peer.py`).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
