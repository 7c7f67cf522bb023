"""Process entry of emulated engines: ``python -m resilience.testing.emulator [--engine sglang|vllm] --port P [flags]``.

One entry for both kinds: ``--engine`` picks the config's flags (SGLang's, or vLLM's in ``vllm/config.py``). It binds
the socket itself (port 0 picks a free one) before the heavy imports (torch, FastAPI), so a port in use fails fast
with a one-line error; prints ``EMULATOR READY http://<host>:<port>`` once uvicorn serves; and serves until
SIGINT/SIGTERM or until the engine dies as the real one does (``crash.py``). ``--engines N`` forks N engines from
one zygote (``serve_many.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .config import EngineConfig, add_config_arguments, config_from_namespace
from .ready import print_ready
from .vllm.config import VLLMEngineConfig, add_vllm_arguments, vllm_config_from_namespace

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["ENGINE_KINDS", "AppFactory", "build_parser", "create_app", "engine_kind", "main", "template_key"]

ENGINE_KINDS = ("sglang", "vllm")
"""The engines the emulator reproduces (``--engine``): SGLang 0.5.23 (the default) or vLLM 0.33.0 (``emulator/vllm/``)."""
AppFactory = Callable[[Any, str, int], "tuple[FastAPI, Any]"]
"""Builds one engine's app: ``factory(config, host, port) -> (app, engine)`` (default: :func:`create_app`)."""


def engine_kind(argv: Sequence[str]) -> str:
    """The ``--engine`` that ``argv`` asks for (``"sglang"`` when absent; an unknown kind is left to the parser's error)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", default="sglang")
    known, _ = pre.parse_known_args(list(argv))
    return str(known.engine)


def build_parser(prog: str | None = None, engine: str = "sglang") -> argparse.ArgumentParser:
    """The command line: ``--engine``, ``--host``, ``--port``, the process flags, and one flag per knob of ``engine``'s config."""
    vllm = engine == "vllm"
    what = (
        "vLLM 0.33.0 engines (control plane, sleep mode and its crashes)" if vllm else "SGLang engines (control plane and crash semantics)"
    )
    dev_mode = " The dev and RL routes exist only with VLLM_SERVER_DEV_MODE=1, as in vLLM." if vllm else ""
    parser = argparse.ArgumentParser(
        prog=prog or "python -m resilience.testing.emulator",
        description=f"Run emulated {what} on the CPU: one, or N with --engines N.{dev_mode}",
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
    levels = ["critical", "error", "warning", "info", "debug"]
    parser.add_argument("--log-level", default="warning", choices=levels, help="uvicorn log level (default: warning)")
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
    (add_vllm_arguments if vllm else add_config_arguments)(parser)
    return parser


def _read_config(args: argparse.Namespace) -> EngineConfig | VLLMEngineConfig:
    """The config the flags of ``args.engine`` give; ValueError names a bad field (or a bad ``VLLM_SERVER_DEV_MODE``)."""
    if args.engine != "vllm":
        return config_from_namespace(args)
    config = vllm_config_from_namespace(args)
    config.resolved_dev_mode()  # a bad VLLM_SERVER_DEV_MODE is named now, not at the first request
    return config


def template_key(argv: Sequence[str]) -> tuple[EngineConfig | VLLMEngineConfig, str] | None:
    """The configuration and host ``argv`` asks for (the zygote's template key); None when the flags are bad."""
    try:
        args, _unknown = build_parser(engine=engine_kind(argv)).parse_known_args(list(argv))
        return _read_config(args), args.host
    except (SystemExit, ValueError):
        return None


def create_app(config: EngineConfig | VLLMEngineConfig, host: str, port: int) -> tuple[FastAPI, Any]:
    """The app and engine of ``config``'s kind: an SGLang ``EngineConfig`` or a ``VLLMEngineConfig``."""
    if isinstance(config, VLLMEngineConfig):
        from .vllm.app import create_app as create_vllm_app

        return create_vllm_app(config, host=host, port=port)
    from .app import create_app as create_sglang_app

    return create_sglang_app(config, host=host, port=port)


def main(
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    on_ready: Callable[[str], None] = print_ready,
    app_factory: AppFactory | None = None,
    logging_configured: bool = False,
) -> int:
    """Run one engine (or N with ``--engines N``) until SIGINT/SIGTERM; returns the exit status.

    ``prog`` names the command in usage lines (e.g. ``"cpr emulate"``). Bad flags print one line on stderr naming
    the command and return 2; a port that cannot be bound returns 1. Call it from the main thread: uvicorn installs
    the signal handlers. ``on_ready`` is called with the engine's URL once uvicorn serves (default:
    :func:`print_ready`; a zygote's child reports to its fleet instead). ``app_factory`` builds the app once the
    port is bound (default: :func:`create_app`; a zygote's child takes the copy of an app its zygote built before
    forking). ``logging_configured``: uvicorn's default logging configuration is in place already (a zygote's child
    inherits it), so it is not applied again (only the level is); default False.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    kind = engine_kind(argv)
    parser = build_parser(prog, kind)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage and the error line
        return exc.code if isinstance(exc.code, int) else 2
    error = f"{parser.prog}: error:"  # every line names the command, as argparse's own errors do
    try:
        config = _read_config(args)
    except ValueError as exc:
        print(f"{error} {exc}", file=sys.stderr)
        return 2
    problem = _process_problem(args)
    if problem:
        print(f"{error} {problem}", file=sys.stderr)
        return 2
    if args.engines > 1:
        if args.exit_with_parent is not None:
            watch_parent(args.exit_with_parent)
        from .serve_many import serve_fleet

        return serve_fleet(
            args.engines,
            config,
            host=args.host,
            port=args.port,
            startup_timeout=args.startup_timeout,
            log_level=args.log_level,
            memory_state_dir=args.memory_state_dir,
        )
    try:
        sock = bind_listener(args.host, args.port)
    except OSError as exc:
        print(f"{error} cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if args.exit_with_parent is not None:
        watch_parent(args.exit_with_parent)
    try:
        port = sock.getsockname()[1]
        if kind == "sglang":
            import torch

            torch.set_num_threads(1)
        app, engine = (app_factory or create_app)(config, args.host, port)
        if args.memory_state_dir is not None:  # the part that publishes the released tags, once the engine starts
            from .memory_state import MemoryStateWriter

            publisher = engine if kind == "vllm" else engine.scheduler
            publisher.memory_state = MemoryStateWriter(args.memory_state_dir, port)
        return run_app(app, sock, listen_url(args.host, port), on_ready, args.log_level, logging_configured)
    finally:
        sock.close()


def _process_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--port``, ``--exit-with-parent``, ``--engines`` or ``--startup-timeout``, or None."""
    if not 0 <= args.port <= 65535:
        return f"`--port` must be in 0..65535, but was {args.port}"
    if args.exit_with_parent is not None:
        problem = parent_problem(args.exit_with_parent)
        if problem:
            return f"--exit-with-parent {args.exit_with_parent}: {problem}"
    if args.engines < 1 or (args.port and args.port + args.engines - 1 > 65535):
        return f"`--engines` must be >= 1 and fit ports {args.port}.. below 65536, but was {args.engines}"
    if not args.startup_timeout > 0:
        return f"`--startup-timeout` must be > 0 seconds, but was {args.startup_timeout}"
    return None


def watch_parent(parent_pid: int) -> None:
    """Start a daemon thread that SIGTERMs this process once ``parent_pid`` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:  # ends when the parent dies (we are re-parented)
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="emulator-parent-watch", daemon=True).start()


def parent_problem(pid: int) -> str | None:
    """Why ``--exit-with-parent PID`` cannot work (no such process, or not our parent), or None when it can.

    The watch compares ``os.getppid()`` with PID, so any other PID would end the engine at once, silently.
    """
    if pid <= 0:
        return f"must be a process ID > 0, but was {pid}"
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return "no process with that PID is running"
    except PermissionError:
        pass  # it exists (owned by someone else)
    if os.getppid() != pid:
        return f"that process is not this engine's parent (the parent is {os.getppid()})"
    return None


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening, inheritable socket on ``host:port`` (0 picks a free port); OSError when it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listen_url(host: str, port: int) -> str:
    """``http://host:port`` (IPv6 hosts in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_app(app: object, sock: socket.socket, url: str, on_ready: Callable[[str], None], log_level: str, logging_configured: bool) -> int:
    """Serve ``app`` with uvicorn on the bound ``sock`` until SIGINT/SIGTERM; ``on_ready(url)`` once it serves; 0.

    ``logging_configured``: as :func:`main`'s (dictConfig walks every logger of the process: in a forked engine that
    copies megabytes of shared pages).
    """
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    class ReadyServer(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                on_ready(url)

    uv_config = uvicorn.Config(
        app,  # type: ignore[arg-type]  # an ASGI app (FastAPI)
        log_config=None if logging_configured else LOGGING_CONFIG,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=1,
        timeout_keep_alive=5,
    )
    ReadyServer(uv_config).run(sockets=[sock])
    return 0
