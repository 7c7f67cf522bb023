"""Real frameworks' colocate cycles behind FaultProxy: cycles completed and engines killed, per mount.

    .venv/bin/python benchmarks/bench_frameworks.py                 # 5 seeds x 5 cycles, every row and column
    .venv/bin/python benchmarks/bench_frameworks.py --seeds 2 --cycles 2 --frameworks verl

Rows: framework (AReaL and verl on SGLang engines, SkyRL 0.4.0 on vLLM engines) x fault
plan (``resilience.testing.frameworks``: ``transient`` =
502s answered by the proxy, never forwarded; ``after`` = the same plus 502s
after forwarding on release and resume). Columns: as shipped, under
``SGLangInstrumentor`` with ``SGLANG_POLICIES`` ("mount"), with the emulator's
memory probe in those policies ("mount + probe"), and with
``SGLANG_STRICT_POLICIES`` ("strict"). Each cell is completed cycles / cycles,
then engines killed; the last column is the most releases one engine got in
one cycle under the mount. Every seed runs on a fresh fleet of 3 engines. The
frameworks keep their own waits (AReaL: 1 s between tries; verl's
``retry_delay`` set to 0.2 s); our backoffs are shortened (``fast_policies``).
Two tables: the plans capped at ``MAX_STREAK`` (5) 502s in a row per path, and
uncapped (issue 31's plan: seeds 0-4, the strict column left out); ``--caps``
picks. Prints markdown; figures go in BENCHMARKS.md and docs/frameworks.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from resilience.testing.frameworks import ENGINE_KIND, FRAMEWORKS, MAX_STREAK, MOUNTS, PLANS, run_seed

_TITLES = {"shipped": "as shipped", "middleware": "mount", "probe": "mount + probe", "strict": "strict preset"}
_PLAN_TITLES = {"transient": "transient 502s (answered by the proxy)", "after": "plus 502s after forwarding on release/resume"}


def _cap(text: str) -> int | None:
    return None if text == "none" else int(text)


def _table(args: argparse.Namespace, cap: int | None, mounts: list[str], seeds: range, out: object, started: float) -> None:
    rows = []
    for framework in args.frameworks:
        for plan in args.plans:
            cells = []
            most = 0
            for mount in mounts:
                if ENGINE_KIND[framework] == "vllm" and mount != "shipped" and mount != "middleware":
                    cells.append("n/a")  # vLLM's sleep and wake are idempotent: no probe or strict form (resilience.testing.frameworks)
                    continue
                runs = [run_seed(framework, plan, mount, seed, cycles=args.cycles, max_streak=cap) for seed in seeds]
                done = sum(r.completed for r in runs)
                deaths = sum(r.deaths for r in runs)
                cells.append(f"{done}/{len(seeds) * args.cycles}, {deaths}")
                if mount == "middleware":
                    most = max(r.most_releases for r in runs)
                took = time.monotonic() - started
                print(f"  cap {cap} {framework} {plan} {mount}: {cells[-1]} ({took:.0f} s)", file=sys.stderr, flush=True)
            rows.append((framework, plan, cells, most))
    header = " | ".join(f"{_TITLES[m]}: cycles / deaths" for m in mounts)
    print(f"| framework, plan | {header} | most releases per engine and cycle (mount) |", file=out)
    print("|---|" + "---|" * (len(mounts) + 1), file=out)
    for framework, plan, cells, most in rows:
        name = {"areal": "AReaL 1.0.4", "verl": "verl 0.9.1", "skyrl": "SkyRL 0.4.0 (vLLM)"}[framework]
        print(f"| {name}, {_PLAN_TITLES[plan]} | " + " | ".join(cells) + f" | {most if 'middleware' in mounts else '-'} |", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per cell (default 5)")
    parser.add_argument("--cycles", type=int, default=5, help="cycles per seed (default 5)")
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--plans", nargs="+", choices=PLANS, default=list(PLANS))
    parser.add_argument("--mounts", nargs="+", choices=MOUNTS, default=list(MOUNTS))
    parser.add_argument(
        "--caps",
        nargs="+",
        type=_cap,
        default=[MAX_STREAK, None],
        help=f"the plans' most 502s in a row per path, 'none' for no cap (default {MAX_STREAK} none: both tables)",
    )
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.cycles < 1:
        parser.error("--seeds and --cycles must be >= 1")
    logging.disable(logging.WARNING)
    out = os.fdopen(os.dup(1), "w")  # the table; AReaL logs every retry to stdout through its own handlers
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    started = time.monotonic()
    command = " ".join(["benchmarks/bench_frameworks.py", *(argv if argv is not None else sys.argv[1:])]).strip()
    print("## Real framework client code behind FaultProxy\n", file=out)
    print(f"`{command}`: AReaL's and verl's own offload/onload cycles on 3 emulated SGLang engines, SkyRL's on 3 emulated", file=out)
    print("vLLM engines: completed cycles and engines killed per mount (`resilience.testing.frameworks`; docs/frameworks.md", file=out)
    print("explains the columns). 502s before forwarding with probability 0.4 on pause, continue, flush, release and resume", file=out)
    print("(vLLM: is_sleeping, sleep, wake_up); the `after` plan adds 502s after forwarding with probability 0.3 on release and", file=out)
    print("resume (vLLM: sleep and wake_up). SkyRL's rows have no probe or strict column: vLLM's sleep and wake are idempotent.", file=out)
    for cap in args.caps:
        if cap is None:
            seeds = range(args.seeds)  # issue 31's plan: seeds 0-4, no cap on 502s in a row
            mounts = [m for m in args.mounts if m != "strict"]
            print(f"\n### No cap on 502s in a row (issue 31's plan), seeds 0-{args.seeds - 1}\n", file=out)
        else:
            seeds = range(1, args.seeds + 1)
            mounts = list(args.mounts)
            print(f"\n### At most {cap} 502s in a row per path, seeds 1-{args.seeds}\n", file=out)
        _table(args, cap, mounts, seeds, out, started)
    print(f"\n{args.seeds} seeds x {args.cycles} cycles x 3 engines per cell; {time.monotonic() - started:.0f} s in all.", file=out)
    out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
