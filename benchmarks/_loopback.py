"""Minimal HTTP servers for benchmarks, each in its own process so its CPU does not share the driver's GIL.

- ``SERVER``: a ``ThreadingHTTPServer`` answering every GET/POST with 200 ``ok``. Start it with
  ``subprocess.Popen([sys.executable, "-c", SERVER], stdout=PIPE, text=True)``; it prints its
  127.0.0.1 port on the first line.
- ``LoopbackServer``: one asyncio HTTP/1.1 server (keep-alive, Content-Length bodies; what requests,
  httpx and aiohttp send) answering 200 ``ok`` at once, and 502 to every ``fail_every``-th request
  when asked; a context manager that also reports what it served.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import textwrap
import time
from multiprocessing.connection import Connection
from types import TracebackType

__all__ = ["SERVER", "LoopbackServer"]

SERVER = textwrap.dedent(
    """
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall
        def _answer(self):
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
        do_GET = do_POST = _answer
        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    print(srv.server_address[1], flush=True)
    srv.serve_forever()
    """
)

_OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
_BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/plain\r\ncontent-length: 11\r\n\r\nbad gateway"
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0


class _Counts:
    """Requests served and 502s among them (one event loop: no lock needed)."""

    def __init__(self) -> None:
        self.served = 0
        self.failed = 0
        self.connections = 0


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fail_every: int, counts: _Counts) -> None:
    counts.connections += 1
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            close = False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection" and value.strip().lower() == b"close":
                    close = True
            if length:
                await reader.readexactly(length)
            counts.served += 1
            if fail_every and counts.served % fail_every == 0:
                counts.failed += 1
                writer.write(_BAD_GATEWAY)
            else:
                writer.write(_OK)
            await writer.drain()
            if close:
                return
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError, asyncio.CancelledError):
        return  # the client went away, or we are stopping
    finally:
        writer.close()


def _serve(fail_every: int, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C stops us through stop(), not mid-answer
    counts = _Counts()

    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: _handle(r, w, fail_every, counts), "127.0.0.1", 0, backlog=1024, reuse_address=True
        )
        conn.send(server.sockets[0].getsockname()[1])
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_message() -> None:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = "stop"
            if message == "counts":
                conn.send((counts.served, counts.failed, counts.connections))
            else:
                stop.set()

        loop.add_reader(conn.fileno(), on_message)
        await stop.wait()
        loop.remove_reader(conn.fileno())
        server.close()

    asyncio.run(main())


class LoopbackServer:
    """An HTTP/1.1 server on 127.0.0.1 in a child process: 200 ``ok`` at once; a context manager.

    ``fail_every``: answer every ``fail_every``-th request (counted across all
    connections) with 502 instead; 0 = never (default). ``url`` is
    ``http://127.0.0.1:<port>`` once started; ``counts()`` asks the server for
    (requests served, 502s sent, connections accepted). Leaving the ``with``
    block stops the child process.
    """

    def __init__(self, fail_every: int = 0) -> None:
        if fail_every < 0 or fail_every == 1:
            raise ValueError(f"LoopbackServer fail_every must be 0 or >= 2, but was {fail_every}")
        self.fail_every = fail_every
        self.port = 0
        ctx = multiprocessing.get_context("spawn")
        self._conn, self._child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(fail_every, self._child_conn), name="loopback-server", daemon=True)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` (no trailing slash)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LoopbackServer:
        """Start the child process and wait (bounded) for its port."""
        self._proc.start()
        self._child_conn.close()
        if not self._conn.poll(_START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"loopback server did not start within {_START_TIMEOUT_S} s")
        try:
            self.port = int(self._conn.recv())
        except EOFError:
            self.stop()
            raise RuntimeError(f"loopback server exited before listening (exit code {self._proc.exitcode})") from None
        return self

    def counts(self) -> tuple[int, int, int]:
        """(requests served, 502s sent, connections accepted) so far."""
        self._conn.send("counts")
        if not self._conn.poll(_START_TIMEOUT_S):
            raise RuntimeError("loopback server did not report its counts")
        served, failed, connections = self._conn.recv()
        return int(served), int(failed), int(connections)

    def stop(self) -> None:
        """Stop the child: ask, wait, then terminate and kill by PID. Idempotent."""
        try:
            self._conn.send("stop")
        except (OSError, ValueError):
            pass
        self._conn.close()
        if self._proc.pid is None:
            return
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        self._proc.join(max(0.0, deadline - time.monotonic()))
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(_STOP_TIMEOUT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(_STOP_TIMEOUT_S)

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
