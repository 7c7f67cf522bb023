"""A small scripted HTTP server on 127.0.0.1 for slow answers and dropped connections.

Each request pops the next action of the script (the last one repeats):
``Reply(status, body, headers)``, ``Late(seconds, status)`` (answer after
``seconds``), ``Hang(seconds)`` (read the request, answer
nothing for ``seconds`` then close), ``Drop()`` (read the request, close the
socket without an answer), ``Reset()`` (close with RST).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: bytes = b"ok"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Late:
    seconds: float = 2.0
    status: int = 200


@dataclass(frozen=True)
class Hang:
    seconds: float = 2.0


@dataclass(frozen=True)
class Drop:
    pass


@dataclass(frozen=True)
class Reset:
    pass


Action = Reply | Late | Hang | Drop | Reset


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class ScriptedServer:
    """A threaded loopback server that plays a script of actions."""

    def __init__(self, script: Sequence[Action], port: int = 0) -> None:
        self.script = list(script)
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with owner._lock:
                    owner.seen.append(Seen(self.command, self.path, dict(self.headers), body))
                    action = owner.script.pop(0) if len(owner.script) > 1 else owner.script[0]
                if isinstance(action, Late):
                    if owner._stop.wait(action.seconds):
                        self.close_connection = True
                        return
                    action = Reply(action.status)
                if isinstance(action, Reply):
                    self.send_response(action.status)
                    for k, v in action.headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(action.body)))
                    self.end_headers()
                    self.wfile.write(action.body)
                elif isinstance(action, Hang):
                    owner._stop.wait(action.seconds)
                    self.close_connection = True
                elif isinstance(action, Reset):
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                else:
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def start(self) -> ScriptedServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.seen)


@contextmanager
def scripted(*script: Action, port: int = 0) -> Iterator[ScriptedServer]:
    """Run a ``ScriptedServer`` for the block and always stop it."""
    server = ScriptedServer(script, port=port).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def silent_listener(*, full: bool) -> Iterator[int]:
    """A loopback port that listens and never accepts; yields the port, closes every socket after the block.

    ``full=False``: the kernel completes the TCP handshake (the backlog has
    room) and nothing ever answers: a TLS handshake on it hangs. ``full=True``:
    ``listen(0)`` with one connection parked in the backlog, so Linux drops
    every further SYN: a connect to it times out.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    parked: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = int(listener.getsockname()[1])
        if full:
            filler = socket.create_connection(("127.0.0.1", port), timeout=5)
            parked.append(filler)
        yield port
    finally:
        for s in parked:
            s.close()
        listener.close()


@contextmanager
def cut_off_stream() -> Iterator[str]:
    """A loopback server that answers each request with a stream's first chunk, then closes the connection; yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    part = conn.recv(65536)
                    if not part:
                        break
                    head += part
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        listener.close()
        thread.join(10.0)
