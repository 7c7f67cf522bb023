"""``cpr dashboards``: regenerate (or ``--check``) grafana/ with the ``grafana.dashboard`` generator, imported from
the checkout this ``resilience`` comes from (it is not in the installed library), else from the current folder.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

import resilience
from resilience.cli.common import CliError

__all__ = ["run_dashboards"]


def _checkout_roots() -> tuple[Path, ...]:
    """Where a source checkout (a folder holding ``grafana/dashboard/``) may be: beside ``resilience``, or here."""
    return (Path(resilience.__file__).resolve().parent.parent, Path.cwd())


def _import_generator() -> ModuleType:
    """The ``grafana.dashboard`` package, with the checkout it lives in put on ``sys.path`` when it is not already."""
    roots = _checkout_roots()
    found = next((root for root in roots if (root / "grafana" / "dashboard" / "__init__.py").is_file()), None)
    if found is None:
        looked = " and ".join(str(root / "grafana" / "dashboard") for root in roots)
        raise CliError(f"grafana/dashboard not found (looked at {looked}); run cpr dashboards from a source checkout")
    if str(found) not in sys.path:
        sys.path.insert(0, str(found))
    try:
        return importlib.import_module("grafana.dashboard")
    except ImportError as exc:
        raise CliError(f"grafana.dashboard needs {exc.name or exc}: pip install 'controlplane-resilience[grafana]'") from None


def run_dashboards(args: argparse.Namespace) -> int:
    """Write the dashboard into ``args.out``/dashboards and the rules into ``args.out``/rules (default: the checkout's
    grafana/), or with ``args.check`` write nothing and return 1 when a file differs from a fresh generation."""
    generator = _import_generator()
    out = Path(args.out) if args.out else Path(str(generator.__file__)).resolve().parent.parent
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {str(out)!r} is not a folder", 2)
    argv = ["--out", str(out / "dashboards"), "--rules-out", str(out / "rules")]
    if args.check:
        argv.append("--check")
    try:
        code = generator.main(argv)
    except OSError as exc:
        raise CliError(f"cannot write under {str(out)!r}: {exc.strerror or exc}") from None
    if args.check:
        if code == 0:
            print(f"{out}: up to date")
        else:
            print(f"{out}: stale (see above); run: cpr dashboards", file=sys.stderr)
    return int(code)
