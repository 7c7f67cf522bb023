"""``cpr emulate --engine vllm``: run emulated vLLM 0.33.0 engines, checking the arguments with their own parser first.

The flags are vLLM's where vLLM has them (``--enable-sleep-mode``, ``--weight-transfer-config``,
``--api-key``, ``--host``, ``--port``) and ``VLLM_SERVER_DEV_MODE`` comes from the environment;
``--engines N`` forks N engines from the shared zygote (``resilience.testing.emulator.vllm``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from resilience.cli.common import OneLineParser

__all__ = ["run_emulate_vllm"]


def run_emulate_vllm(argv: Sequence[str]) -> int:
    """Check ``argv`` (which holds ``--engine vllm``) with the vLLM emulator's parser (one-line errors, exit 2), then serve."""
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
