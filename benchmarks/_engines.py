"""Lightweight fake SGLang engines for benchmarks: N ports on 127.0.0.1, one asyncio loop, one child process.

Every engine answers SGLang's control routes (pause, continue, flush, release,
resume) after sleeping ``latency_s``, and ``/health`` and ``/model_info`` at
once. They keep no state and never fail: they measure the fan-out, not the
engine. The servers run in their own process so their CPU does not share the
driver's GIL, and speak just enough HTTP/1.1 (Content-Length bodies,
keep-alive) for ``requests``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import signal
import time
from multiprocessing.connection import Connection
from types import TracebackType

__all__ = ["FakeEngines"]

_CONTROL_ROUTES = frozenset(
    {"/pause_generation", "/continue_generation", "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation"}
)
_OK_JSON = json.dumps({"success": True, "message": ""}).encode()
_MODEL_INFO = json.dumps({"model_path": "fake/model", "weight_version": "default"}).encode()
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0


def _answer(path: str) -> tuple[int, bytes, str]:
    if path == "/flush_cache":
        return 200, b"Cache flushed.\n", "text/plain"
    if path in _CONTROL_ROUTES:
        return 200, _OK_JSON, "application/json"
    if path == "/health":
        return 200, b"", "text/plain"
    if path == "/model_info":
        return 200, _MODEL_INFO, "application/json"
    return 404, b'{"detail":"Not Found"}', "application/json"


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, latency_s: float) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            _method, target, _version = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            length = int(headers.get("content-length") or 0)
            if length:
                await reader.readexactly(length)
            path = target.split("?", 1)[0]
            status, body, ctype = _answer(path)
            if path in _CONTROL_ROUTES and latency_s > 0:
                await asyncio.sleep(latency_s)
            reason = "OK" if status == 200 else "Not Found"
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n".encode("latin-1") + body
            )
            await writer.drain()
            if headers.get("connection", "").lower() == "close":
                return
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError, asyncio.CancelledError):
        return  # the client went away, or we are stopping
    finally:
        writer.close()


def _serve(n: int, latency_s: float, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C stops us through stop(), not mid-answer

    async def main() -> None:
        servers = [
            await asyncio.start_server(lambda r, w: _handle(r, w, latency_s), "127.0.0.1", 0, backlog=1024, reuse_address=True)
            for _ in range(n)
        ]
        conn.send([s.sockets[0].getsockname()[1] for s in servers])
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_reader(conn.fileno(), stop.set)  # any message, or the parent's end closing, stops us
        await stop.wait()
        for s in servers:
            s.close()

    asyncio.run(main())


class FakeEngines:
    """``n`` fake SGLang engines answering control calls after ``latency_s`` seconds; a context manager.

    ``n``: engines (one port each, default 8). ``latency_s``: the sleep before
    every control answer (default 0.05). ``urls`` lists ``http://127.0.0.1:<port>``
    once started; leaving the ``with`` block stops the child process.
    """

    def __init__(self, n: int = 8, latency_s: float = 0.05) -> None:
        if n < 1:
            raise ValueError(f"FakeEngines n must be >= 1, but was {n}")
        if latency_s < 0:
            raise ValueError(f"FakeEngines latency_s must be >= 0, but was {latency_s}")
        self.n = n
        self.latency_s = latency_s
        self.urls: list[str] = []
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._child_conn = child
        self._proc = ctx.Process(target=_serve, args=(n, latency_s, child), name="fake-sglang-engines", daemon=True)

    def start(self) -> FakeEngines:
        """Start the child process and wait (bounded) for its ports."""
        self._proc.start()
        self._child_conn.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        if not self._conn.poll(max(0.0, deadline - time.monotonic())):
            self.stop()
            raise RuntimeError(f"fake engines did not start within {_START_TIMEOUT_S} s")
        try:
            ports = self._conn.recv()
        except EOFError:
            self.stop()
            raise RuntimeError(f"fake engines exited before listening (exit code {self._proc.exitcode})") from None
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]
        return self

    def stop(self) -> None:
        """Stop the child: ask, wait, then terminate and kill by PID. Idempotent."""
        try:
            self._conn.send("stop")
        except (OSError, ValueError):
            pass
        self._conn.close()
        if self._proc.pid is None:
            return
        self._proc.join(_STOP_TIMEOUT_S)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(_STOP_TIMEOUT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(_STOP_TIMEOUT_S)

    def __enter__(self) -> FakeEngines:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
