"""``cpr emulate``: run emulated SGLang engines, checking the arguments with the emulator's own parser first."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from resilience.cli.common import OneLineParser

__all__ = ["run_emulate"]


def run_emulate(argv: Sequence[str]) -> int:
    """Check ``argv`` with the emulator's own parser (errors in one line, exit 2), then hand over to it."""
    from resilience.testing.emulator import main as emulator_main
    from resilience.testing.emulator.config import config_from_namespace
    from resilience.testing.emulator.server import build_parser as emulator_parser

    parser = emulator_parser("cpr emulate")
    parser.__class__ = OneLineParser  # same parser, one-line errors
    try:
        args = parser.parse_args(list(argv))
        config_from_namespace(args)
        if not 0 <= args.port <= 65535:
            parser.error(f"argument --port: must be a port number 0..65535, but was {args.port}")
    except SystemExit as exc:  # --help, or a one-line argument error
        return exc.code if isinstance(exc.code, int) else 0
    except ValueError as exc:
        print(f"cpr emulate: error: {exc}", file=sys.stderr)
        return 2
    return emulator_main(list(argv), prog="cpr emulate")
