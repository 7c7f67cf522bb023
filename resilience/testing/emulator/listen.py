"""What every engine entry does with its process before serving: bind the port, check and watch its parent.

Shared by the SGLang entry (``server.py``) and the vLLM one (``vllm/server.py``) without either importing the
other: standard library only, but for the fleet (``serve_many.py``, imported when ``--engines`` asks for more than one)
and ``memory_state.py`` (with ``--memory-state-dir``).
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
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .config import EngineConfig
    from .vllm.config import VLLMEngineConfig

__all__ = ["bind_listener", "engine_main", "listen_url", "parent_problem", "run_app", "serve_entry", "watch_parent"]

C = TypeVar("C", "EngineConfig", "VLLMEngineConfig")


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


def engine_main(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    read_config: Callable[[argparse.Namespace], C],
    build: Callable[[C, str, int], tuple[object, Any]],
    on_ready: Callable[[str], None],
    logging_configured: bool,
) -> int:
    """An engine entry's ``main`` once its ``parser`` is built; the exit status.

    Parses ``argv`` (argparse prints its own errors: 2), reads the engine's config with ``read_config(args)`` (a
    ValueError is one line naming the command: 2), then :func:`serve_entry`: ``--engines`` N > 1 forked from one
    zygote (``serve_many.serve_fleet``), else one engine on the bound port: ``build(config, host, port)`` gives its
    app and the part that publishes its released tags (given a ``MemoryStateWriter`` as ``memory_state`` with
    ``--memory-state-dir``), served by :func:`run_app` (``on_ready``, ``logging_configured``: as there).
    """
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage and the error line
        return exc.code if isinstance(exc.code, int) else 2
    error = f"{parser.prog}: error:"  # every line names the command, as argparse's own errors do
    try:
        config = read_config(args)
    except ValueError as exc:
        print(f"{error} {exc}", file=sys.stderr)
        return 2

    def serve_many() -> int:
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

    def serve_one(sock: socket.socket) -> int:
        port = sock.getsockname()[1]
        app, publisher = build(config, args.host, port)
        if args.memory_state_dir is not None:
            from .memory_state import MemoryStateWriter

            publisher.memory_state = MemoryStateWriter(args.memory_state_dir, port)  # published once the engine starts
        return run_app(app, sock, listen_url(args.host, port), on_ready, args.log_level, logging_configured)

    return serve_entry(args, error, serve_one, serve_many)


def serve_entry(
    args: argparse.Namespace, error: str, serve_one: Callable[[socket.socket], int], serve_many: Callable[[], int]
) -> int:
    """The checks and the start every engine entry shares, once its config is read from ``args``; the exit status.

    ``args`` carries ``host``, ``port``, ``engines``, ``startup_timeout`` and ``exit_with_parent``; ``error`` begins
    each error line (``"<prog>: error:"``). Bad values print one line and give 2; then ``serve_many()`` runs a fleet
    (``--engines`` > 1), or ``serve_one(sock)`` serves on the bound port (1 when it cannot be bound).
    """
    if not 0 <= args.port <= 65535:
        print(f"{error} `--port` must be in 0..65535, but was {args.port}", file=sys.stderr)
        return 2
    if args.exit_with_parent is not None:
        problem = parent_problem(args.exit_with_parent)
        if problem:
            print(f"{error} --exit-with-parent {args.exit_with_parent}: {problem}", file=sys.stderr)
            return 2
    if args.engines < 1 or (args.port and args.port + args.engines - 1 > 65535):
        print(f"{error} `--engines` must be >= 1 and fit ports {args.port}.. below 65536, but was {args.engines}", file=sys.stderr)
        return 2
    if not args.startup_timeout > 0:
        print(f"{error} `--startup-timeout` must be > 0 seconds, but was {args.startup_timeout}", file=sys.stderr)
        return 2
    if args.engines > 1:
        if args.exit_with_parent is not None:
            watch_parent(args.exit_with_parent)
        return serve_many()
    try:
        sock = bind_listener(args.host, args.port)
    except OSError as exc:
        print(f"{error} cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if args.exit_with_parent is not None:
        watch_parent(args.exit_with_parent)
    try:
        return serve_one(sock)
    finally:
        sock.close()


def run_app(app: object, sock: socket.socket, url: str, on_ready: Callable[[str], None], log_level: str, logging_configured: bool) -> int:
    """Serve ``app`` with uvicorn on the bound ``sock`` until SIGINT/SIGTERM; ``on_ready(url)`` once it serves; 0.

    ``logging_configured``: uvicorn's logging configuration is in place already (a zygote's child inherits it), so
    it is not applied again (dictConfig walks every logger of the process: in a forked engine that copies megabytes
    of shared pages); only ``log_level`` is.
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
