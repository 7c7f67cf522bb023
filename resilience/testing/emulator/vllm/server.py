"""Process entry of one emulated vLLM engine: ``python -m resilience.testing.emulator --engine vllm [flags]``.

Flags are vLLM's where vLLM has them (``config.py``). Binds the socket first (port 0
picks a free one), prints ``EMULATOR READY http://<host>:<port>`` once uvicorn serves,
and serves until SIGINT/SIGTERM or until the engine dies of an illegal memory access
(``crash.py``). ``--engines N`` forks N engines from one zygote (the shared fleet).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..listen import engine_main
from ..ready import print_ready
from .config import ENGINE_KIND, VLLMEngineConfig, add_vllm_arguments, vllm_config_from_namespace

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["VLLMAppFactory", "build_parser", "main", "template_key"]

VLLMAppFactory = Callable[[VLLMEngineConfig, str, int], "tuple[FastAPI, Any]"]
"""Builds one engine's app: ``factory(config, host, port) -> (app, engine)`` (default: ``app.create_app``)."""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line: ``--engine vllm``, the process flags, and vLLM's own flags (``config.py``)."""
    parser = argparse.ArgumentParser(
        prog=prog or "python -m resilience.testing.emulator",
        description="Run emulated vLLM 0.33.0 engines (control plane, sleep mode and its crashes) on the CPU. "
        "The dev and RL routes exist only with VLLM_SERVER_DEV_MODE=1, as in vLLM.",
    )
    parser.add_argument("--engine", choices=[ENGINE_KIND], required=True, help="vllm: emulate vLLM 0.33.0")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default: 0)")
    parser.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn log level"
    )
    parser.add_argument("--exit-with-parent", type=int, default=None, metavar="PID", help="exit when the process PID is gone")
    parser.add_argument(
        "--memory-state-dir",
        default=None,
        metavar="DIR",
        help="keep DIR/engine-<port>.json up to date with the tags asleep (the shared side channel; default: none)",
    )
    parser.add_argument("--engines", type=int, default=1, metavar="N", help="run N engines forked from one zygote (default: 1)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS", help="with --engines N > 1 (default: 600)")
    add_vllm_arguments(parser)
    return parser


def template_key(argv: Sequence[str]) -> tuple[VLLMEngineConfig, str] | None:
    """The configuration and host ``argv`` asks for (the zygote's template key); None when the flags are bad."""
    try:
        args, _unknown = build_parser().parse_known_args(list(argv))
        return vllm_config_from_namespace(args), args.host
    except (SystemExit, ValueError):
        return None


def main(
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    on_ready: Callable[[str], None] = print_ready,
    app_factory: VLLMAppFactory | None = None,
    logging_configured: bool = False,
) -> int:
    """Run one engine (or N with ``--engines N``) until SIGINT/SIGTERM; returns the exit status (2: bad flags, 1: bind failed).

    The keywords mean what they mean for the SGLang entry (``emulator/server.py`` ``main``).
    """

    def read_config(args: argparse.Namespace) -> VLLMEngineConfig:
        config = vllm_config_from_namespace(args)
        config.resolved_dev_mode()  # a bad VLLM_SERVER_DEV_MODE is named now, not at the first request
        return config

    def build(config: VLLMEngineConfig, host: str, port: int) -> tuple[FastAPI, Any]:
        if app_factory is None:
            from .app import create_app

            app, engine = create_app(config, host=host, port=port)
        else:
            app, engine = app_factory(config, host, port)
        return app, engine.core

    return engine_main(build_parser(prog), argv, read_config, build, on_ready, logging_configured)
