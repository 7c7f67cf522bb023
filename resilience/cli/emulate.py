"""``cpr emulate``: run emulated SGLang engines (vLLM ones with ``--engine vllm``), checking the arguments with its own parser first."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from resilience.cli.common import OneLineParser

__all__ = ["run_emulate"]


def run_emulate(argv: Sequence[str]) -> int:
    """Check ``argv`` with the emulator's own parser (errors in one line, exit 2), then hand over to it."""
    from resilience.testing.emulator.server import engine_kind

    if engine_kind(argv) == "vllm":
        from resilience.testing.emulator.vllm.config import vllm_config_from_namespace
        from resilience.testing.emulator.vllm.server import build_parser as vllm_parser

        def check_vllm(args: argparse.Namespace) -> None:
            vllm_config_from_namespace(args).resolved_dev_mode()  # a bad VLLM_SERVER_DEV_MODE is named too

        return _checked(argv, vllm_parser("cpr emulate"), check_vllm)
    from resilience.testing.emulator.config import config_from_namespace
    from resilience.testing.emulator.server import build_parser as emulator_parser

    return _checked(argv, emulator_parser("cpr emulate"), config_from_namespace)


def _checked(argv: Sequence[str], parser: argparse.ArgumentParser, check: Callable[[argparse.Namespace], object]) -> int:
    from resilience.testing.emulator import main as emulator_main

    parser.__class__ = OneLineParser  # same parser, one-line errors
    try:
        args = parser.parse_args(list(argv))
        check(args)
        if not 0 <= args.port <= 65535:
            parser.error(f"argument --port: must be a port number 0..65535, but was {args.port}")
    except SystemExit as exc:  # --help, or a one-line argument error
        return exc.code if isinstance(exc.code, int) else 0
    except ValueError as exc:
        print(f"cpr emulate: error: {exc}", file=sys.stderr)
        return 2
    return emulator_main(list(argv), prog="cpr emulate")
