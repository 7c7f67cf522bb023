"""The zygote: one process that imports torch and the emulator's app once, then forks one child per engine.

Run by :class:`~resilience.testing.emulator.processes.Zygote` as ``python -m resilience.testing.emulator.zygote
--exit-with-parent PID``. For each distinct engine configuration it builds one engine and its app
(``server.create_app``) that it never starts; each child gets its own copy by ``fork()`` and only binds its port and
runs uvicorn, the pages staying shared copy-on-write until the child writes them (``gc.freeze()`` before each fork
keeps the children's collections off them). The zygote starts no thread, event loop or socket, and checks it is
single-threaded before each fork (a lock another thread holds would stay held forever in the child).

Each child is an ordinary engine process from then on and dies alone, as the real engine's processes do (no sibling
and not the zygote holds its socket, so its port refuses connections once it is gone); it dies with the zygote
(``PR_SET_PDEATHSIG``).

Protocol, one JSON object per line. On stdin, from the fleet::

    {"op": "spawn", "id": K, "argv": [engine flags], "stdout": PATH, "stderr": PATH}

On stdout, to the fleet (each line one ``os.write`` below ``PIPE_BUF``, so lines of
the zygote and of its children never interleave)::

    {"ev": "hello", "pid": P}              imports done; spawn commands are served
    {"ev": "spawned", "id": K, "pid": P}   child K forked
    {"ev": "ready", "id": K, "url": U}     child K serves (written by the child)
    {"ev": "exit", "pid": P, "code": C}    child reaped; C as Popen.returncode (-9: SIGKILL)
    {"ev": "failed", "id": K, "message": M}  child K could not be forked

End of stdin, SIGTERM, or the parent's death: the zygote SIGKILLs the children it
still has, reaps them, reports their exits, and exits.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import select
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from .server import create_app, template_key
from .server import main as engine_main

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["main"]

_PARENT_POLL_S = 0.5
_READ_CHUNK = 1 << 16
_PR_SET_PDEATHSIG = 1
_Template = tuple["FastAPI", Any]
"""A never-started app and its engine (an SGLang ``Engine`` or a vLLM ``EngineCore``)."""


def _emit(fd: int, event: dict[str, Any]) -> None:
    """Write one event line with a single ``write`` (atomic on a pipe: lines are far below PIPE_BUF)."""
    os.write(fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())


def _warm() -> None:
    """Import everything an engine needs; start nothing."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import fastapi.telemetry._runtime  # noqa: F401  (imported at an app's startup otherwise)
    import torch
    import uvicorn
    import uvicorn.loops.auto  # imported at a server's startup otherwise

    from . import app as _app_module  # noqa: F401  (FastAPI, starlette, pydantic and the routes)
    from .vllm import app as _vllm_app_module  # noqa: F401  (the vLLM engine's routes)

    torch.set_num_threads(1)  # before any parallel op: the intra-op pool is never started here

    async def nothing(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never called
        return None

    # uvicorn's default logging configuration, once for every child; and the loop, protocol and lifespan modules
    uvicorn.Config(nothing, lifespan="on", log_level="warning").load()
    gc.collect()


def _die_with_parent(zygote_pid: int) -> None:
    """SIGKILL this child when the zygote ends (``prctl(PR_SET_PDEATHSIG)``), or now if it ended already."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != zygote_pid:
        os._exit(1)


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def _child(command: dict[str, Any], zygote_pid: int, close: Sequence[int], template: _Template | None) -> NoReturn:
    """Become engine ``command["id"]``: logs on fds 1 and 2, report READY on a copy of the zygote's stdout.

    ``template``: this child's copy of the never-started app and engine the zygote built
    for its configuration, served once the port is bound (None: build one here).
    """
    code = 1
    try:
        _die_with_parent(zygote_pid)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        report = os.dup(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for target, path in ((1, command["stdout"]), (2, command["stderr"])):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, target)
            os.close(fd)
        ident = command["id"]

        def on_ready(url: str) -> None:
            _emit(report, {"ev": "ready", "id": ident, "url": url})
            os.close(report)

        def from_template(config: Any, host: str, port: int) -> _Template:
            if template is None:
                return create_app(config, host, port)
            app, engine = template
            if hasattr(engine, "port"):
                engine.port = port  # the only field that differs between copies (SGLang's ``/server_info`` reports it)
            return app, engine

        code = engine_main(command["argv"], on_ready=on_ready, app_factory=from_template, logging_configured=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


class _Server:
    """The zygote's loop: read spawn commands, fork, reap, report."""

    def __init__(self, parent_pid: int | None) -> None:
        self._parent_pid = parent_pid
        self._children: dict[int, int] = {}
        self._templates: dict[tuple[Any, str], _Template] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def run(self) -> int:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the fleet's process, which stops us
        signal.signal(signal.SIGTERM, _raise_exit)
        signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)
        signal.set_wakeup_fd(self._wake_w)
        try:
            _emit(1, {"ev": "hello", "pid": os.getpid()})
            self._loop()
        finally:
            self._kill_all()
        return 0

    def _parent_gone(self) -> bool:
        return self._parent_pid is not None and os.getppid() != self._parent_pid

    def _loop(self) -> None:
        buffer = b""
        while not self._parent_gone():  # ends on EOF, SIGTERM or the parent's death
            readable, _, _ = select.select([0, self._wake_r], [], [], _PARENT_POLL_S)
            if self._wake_r in readable:
                _drain(self._wake_r)
            self._reap()
            if 0 not in readable:
                continue
            data = os.read(0, _READ_CHUNK)
            if not data:
                return
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.strip():
                    self._spawn(json.loads(line))

    def _spawn(self, command: dict[str, Any]) -> None:
        ident = command["id"]
        threads = _threads()
        if threads != 1:
            self._refuse(command, f"the zygote runs {threads} threads; forking it is unsafe")
            return
        template = self._template(command["argv"])
        gc.freeze()  # the children's collections skip (and so never dirty) everything built so far
        zygote_pid = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:
            self._refuse(command, f"fork failed: {exc}")
            return
        if pid == 0:
            _child(command, zygote_pid, (self._wake_r, self._wake_w), template)
        self._children[pid] = ident
        _emit(1, {"ev": "spawned", "id": ident, "pid": pid})

    def _template(self, argv: Sequence[str]) -> _Template | None:
        """The never-started app and engine for ``argv``'s configuration, built on first use (None: bad flags)."""
        key = template_key(argv)
        if key is None:
            return None
        if key not in self._templates:
            config, host = key
            app, engine = create_app(config, host, 0)
            app.middleware_stack = app.build_middleware_stack()  # what starlette builds on the first request
            self._templates[key] = (app, engine)
        return self._templates[key]

    @staticmethod
    def _refuse(command: dict[str, Any], message: str) -> None:
        """Tell the engine's log and the fleet that engine ``command["id"]`` was not forked."""
        try:
            with open(command["stderr"], "a", encoding="utf-8") as log:
                log.write(f"emulator zygote: {message}\n")
        except OSError:
            pass
        _emit(1, {"ev": "failed", "id": command["id"], "message": message})

    def _reap(self) -> None:
        while self._children:  # at most one turn per child
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._report(pid, status)

    def _report(self, pid: int, status: int) -> None:
        self._children.pop(pid, None)
        _emit(1, {"ev": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    def _kill_all(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for pid in list(self._children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(self._children):
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                self._children.pop(pid, None)
                continue
            try:
                self._report(pid, status)
            except OSError:  # the fleet closed its end: nobody listens any more
                self._children.pop(pid, None)


def _raise_exit(_sig: int, _frame: object) -> None:
    raise SystemExit(0)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):  # non-blocking: ends with BlockingIOError when empty
            pass
    except BlockingIOError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Warm up, say hello, serve spawn commands until stdin ends; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m resilience.testing.emulator.zygote")
    parser.add_argument("--exit-with-parent", type=int, default=None, metavar="PID", help="exit when PID is no longer our parent")
    args = parser.parse_args(argv)
    _warm()
    return _Server(args.exit_with_parent).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
