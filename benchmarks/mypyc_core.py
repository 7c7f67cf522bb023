"""Would a compiled core pay? The sans-IO modules built with mypyc in a scratch copy, measured against the pure-Python ones.

Run: ``python benchmarks/mypyc_core.py [--modules retry/spec,retry/call,...] [--runs 3]``

Copies this checkout's ``resilience`` package (and its ``adapters`` and
``telemetry`` folders) into a temporary folder, compiles the named core
modules there with mypyc (``mypyc.build.mypycify``, ``build_ext --inplace``;
needs a C compiler), checks that the compiled modules are the ones imported,
and runs ``benchmarks/micro_success_path.py`` alternately on the scratch
copy and on this checkout, ``--runs`` times each. Nothing in the repository
is built or changed. Measured by hand; not run by ``run_all.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = "outcome,deadline,backoff,retry/spec,retry/call,retry/retrier"
"""The sans-IO modules of the success path (``resilience/<name>.py``).

``breaker`` and ``budget`` are left out: they define exceptions that subclass builtins, which mypyc does not compile."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--modules", default=DEFAULT, help=f"core modules to compile (default {DEFAULT})")
    ap.add_argument("--runs", type=int, default=3, help="runs of each build, alternated (default 3)")
    args = ap.parse_args(argv)
    modules = [m.strip() for m in args.modules.split(",") if m.strip()]
    with tempfile.TemporaryDirectory(prefix="mypyc-core-") as tmp:
        scratch = Path(tmp)
        for folder in ("resilience", "adapters", "telemetry"):
            shutil.copytree(ROOT / folder, scratch / folder, symlinks=True)
        paths = [f"resilience/{m}.py" for m in modules]
        (scratch / "setup.py").write_text(
            textwrap.dedent(
                f"""
                from setuptools import setup
                from mypyc.build import mypycify
                setup(name="scratch", ext_modules=mypycify({paths!r}, opt_level="3"))
                """
            )
        )
        build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=scratch, capture_output=True, text=True)
        if build.returncode != 0:
            print(f"mypyc build failed (exit {build.returncode}):\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}")
            return 1
        check = subprocess.run(
            [sys.executable, "-c", "import resilience.retry.call as m; print(m.__file__)"],
            cwd=scratch,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(scratch)},
        )
        print(f"compiled: {', '.join(modules)}; resilience.retry.call imported from {check.stdout.strip() or check.stderr[-500:]}")
        for i in range(args.runs):
            for name, path in (("pure Python", ROOT), ("mypyc", scratch)):
                proc = subprocess.run(
                    [sys.executable, str(ROOT / "benchmarks" / "micro_success_path.py"), "--calls", "10000", "--repeats", "5"],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    env={**os.environ, "PYTHONPATH": str(path)},
                )
                print(f"--- {name}, run {i + 1}/{args.runs}, exit {proc.returncode}")
                print(proc.stdout.strip() if proc.returncode == 0 else proc.stderr[-2000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
