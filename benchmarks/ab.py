"""A/B of one benchmark between two commits: the same command, run alternately in a checkout of each.

Run: ``python benchmarks/ab.py A B [--runs 3] [--grep TEXT ...] -- SCRIPT [ARGS ...]``

``A`` and ``B`` are commits (anything ``git rev-parse`` reads). Each gets a
detached ``git worktree`` in a temporary folder. ``SCRIPT`` (a path in this
checkout, e.g. ``benchmarks/bench_async_overhead.py``: the same benchmark
code for both) runs with ``ARGS`` and this interpreter, with that commit's
checkout first on ``PYTHONPATH``, so it imports that commit's ``resilience``. The runs alternate A, B, A, B,
... ``--runs`` times each, so the machine's drift falls on both alike. Each
run's stdout lines that contain every ``--grep`` text (default: the table
rows naming ``ours``) are printed under the run's name and commit. The
worktrees are removed whatever happens. Measured by hand; not run by
``run_all.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: ab.py A B [--runs N] [--grep TEXT ...] -- SCRIPT [ARGS ...]", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("a", help="the first commit")
    ap.add_argument("b", help="the second commit")
    ap.add_argument("--runs", type=int, default=3, help="runs of each commit, alternated (default 3)")
    ap.add_argument("--grep", action="append", default=None, help="print lines containing this (repeatable; default 'ours')")
    args = ap.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command or args.runs < 1:
        ap.error("give a script after '--', and --runs >= 1")
    wanted = args.grep or ["ours"]
    commits = {"A": git("rev-parse", "--short", args.a), "B": git("rev-parse", "--short", args.b)}
    with tempfile.TemporaryDirectory(prefix="ab-") as tmp:
        trees = {name: Path(tmp) / name for name in commits}
        try:
            for name, commit in commits.items():
                git("worktree", "add", "--detach", str(trees[name]), commit)
            for i in range(args.runs):
                for name, commit in commits.items():
                    tree = trees[name]
                    started = time.monotonic()
                    proc = subprocess.run(
                        [sys.executable, str(ROOT / command[0]), *command[1:]],
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        timeout=3600,
                        env={**os.environ, "PYTHONPATH": str(tree)},
                    )
                    took = time.monotonic() - started
                    print(f"--- {name} ({commit}), run {i + 1}/{args.runs}, {took:.0f} s, exit {proc.returncode}", flush=True)
                    if proc.returncode != 0:
                        print(proc.stderr[-2000:])
                    for line in proc.stdout.splitlines():
                        if all(w in line for w in wanted):
                            print(line, flush=True)
        finally:
            for tree in trees.values():
                if tree.exists():
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False, capture_output=True)
            subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False, capture_output=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
