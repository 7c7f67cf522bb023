"""``cpr emulate``: run emulated SGLang engines, checking the arguments with the emulator's own parser first."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from resilience.cli.common import OneLineParser

__all__ = ["run_emulate"]


def run_emulate(argv: Sequence[str]) -> int:
    """Check ``argv`` with the emulator's own parser (errors in one line, exit 2), then hand over to it."""
    from resilience.testing.emulator.server import engine_kind

    if engine_kind(argv) == "vllm":
        return _run_vllm_emulate(argv)
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


def _run_vllm_emulate(argv: Sequence[str]) -> int:
    """``cpr emulate --engine vllm``: the vLLM emulator's own parser and flags (vLLM's names), errors in one line, exit 2."""
    from resilience.testing.emulator.server import main as emulator_main
    from resilience.testing.emulator.vllm.config import vllm_config_from_namespace
    from resilience.testing.emulator.vllm.server import build_parser

    parser = build_parser("cpr emulate")
    parser.__class__ = OneLineParser  # same parser, one-line errors
    try:
        args = parser.parse_args(list(argv))
        vllm_config_from_namespace(args).resolved_dev_mode()  # a bad VLLM_SERVER_DEV_MODE is named too
        if not 0 <= args.port <= 65535:
            parser.error(f"argument --port: must be a port number 0..65535, but was {args.port}")
    except SystemExit as exc:  # --help, or a one-line argument error
        return exc.code if isinstance(exc.code, int) else 0
    except ValueError as exc:
        print(f"cpr emulate: error: {exc}", file=sys.stderr)
        return 2
    return emulator_main(list(argv), prog="cpr emulate")
