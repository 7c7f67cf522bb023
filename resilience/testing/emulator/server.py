"""Process entry of one emulated engine: ``python -m resilience.testing.emulator --port P [flags]``.

Binds the socket itself (port 0 picks a free one), prints one line
``EMULATOR READY http://<host>:<port>`` on stdout once uvicorn serves, and hands
the socket to uvicorn. Heavy imports (torch, FastAPI) happen after the bind, so a
port in use fails fast with a one-line error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from .config import EngineConfig, add_config_arguments, config_from_namespace
from .listen import engine_main
from .ready import print_ready

if TYPE_CHECKING:
    from fastapi import FastAPI

    from .engine import Engine
    from .scheduler import Scheduler
    from .vllm.server import VLLMAppFactory

__all__ = ["AppFactory", "build_parser", "main"]

AppFactory = Callable[[EngineConfig, str, int], "tuple[FastAPI, Engine]"]
"""Builds one engine's app: ``factory(config, host, port) -> (app, engine)`` (default: ``app.create_app``)."""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line: ``--host``, ``--port``, ``--log-level``, ``--engines`` and one flag per EngineConfig field."""
    parser = argparse.ArgumentParser(
        prog=prog or "python -m resilience.testing.emulator",
        description="Run emulated SGLang engines (control plane and crash semantics) on the CPU: one, or N with --engines N.",
        allow_abbrev=False,  # an abbreviation must not silently stand for another flag (--engine for --engines)
    )
    parser.add_argument(
        "--engine",
        choices=ENGINE_KINDS,
        default="sglang",
        help="which engine to emulate; `--engine vllm --help` lists vLLM's flags (default: sglang)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default: 0)")
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level (default: warning)",
    )
    parser.add_argument(
        "--exit-with-parent",
        type=int,
        default=None,
        metavar="PID",
        help="exit when the process PID (the parent) is gone, so a killed test run leaves no engine behind",
    )
    parser.add_argument(
        "--memory-state-dir",
        default=None,
        metavar="DIR",
        help="keep DIR/engine-<port>.json up to date with the tags this engine has released, for "
        "resilience.testing.EmulatorMemoryProbe (a side channel, not an HTTP route; default: none)",
    )
    parser.add_argument(
        "--engines",
        type=int,
        default=1,
        metavar="N",
        help="run N engines, forked from one zygote, on ports PORT, PORT+1, ... (free ports when PORT is 0); "
        "prints one READY line per engine once all serve (default: 1)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="with --engines N > 1: seconds to wait for every engine to serve (default: 600)",
    )
    add_config_arguments(parser)
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    on_ready: Callable[[str], None] = print_ready,
    app_factory: AppFactory | None = None,
    logging_configured: bool = False,
) -> int:
    """Run one engine until SIGINT/SIGTERM (or until it dies like SGLang). Returns the exit status.

    ``prog`` names the command in usage lines (e.g. ``"cpr emulate"``). Errors in the
    arguments or the bind print one line on stderr and return 2 or 1. Call it from
    the main thread: uvicorn installs the signal handlers. ``on_ready`` is called
    with the engine's URL once uvicorn serves (default: :func:`print_ready`; a
    zygote's child reports to its fleet instead). ``app_factory`` builds the app
    once the port is bound (default: ``app.create_app``; a zygote's child takes the
    copy of an app its zygote built before forking). ``logging_configured``: uvicorn's
    default logging configuration is in place already (a zygote's child inherits it),
    so it is not applied again (only the level is); default False.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if engine_kind(argv) == "vllm":
        from .vllm.server import main as vllm_main

        # a factory handed to this entry (the zygote's child) builds the app of the kind its argv names
        factory = cast("VLLMAppFactory | None", app_factory)
        return vllm_main(argv, prog=prog, on_ready=on_ready, app_factory=factory, logging_configured=logging_configured)

    def build(config: EngineConfig, host: str, port: int) -> tuple[FastAPI, Scheduler]:
        import torch

        torch.set_num_threads(1)
        app, engine = (app_factory or _default_factory)(config, host, port)
        return app, engine.scheduler

    return engine_main(build_parser(prog), argv, config_from_namespace, build, on_ready, logging_configured)


def _default_factory(config: EngineConfig, host: str, port: int) -> tuple[FastAPI, Engine]:
    from .app import create_app

    return create_app(config, host=host, port=port)


# the engine switch: ``--engine vllm`` hands the whole command line to ``vllm/server.py``
__all__ += ["ENGINE_KINDS", "engine_kind"]

ENGINE_KINDS = ("sglang", "vllm")
"""The engines the emulator reproduces (``--engine``): SGLang 0.5.23 (the default) or vLLM 0.33.0 (``emulator/vllm/``)."""


def engine_kind(argv: Sequence[str]) -> str:
    """The ``--engine`` that ``argv`` asks for (``"sglang"`` when absent; an unknown kind is left to the parser's error)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", default="sglang")
    known, _ = pre.parse_known_args(list(argv))
    return str(known.engine)
