"""FaultProxy: a real HTTP reverse proxy on loopback that injects a FaultPlan's faults.

It plays the nginx of the second seed in front of one engine: it forwards requests, streams answers back (SSE
included) and, where the plan says so, answers 502 with an empty body, resets, delays or hangs, before or after
the engine acted. Built on ``ThreadingHTTPServer`` (the standard library's tested request parser), with every
client and upstream socket and every thread tracked, so :meth:`FaultProxy.stop` shuts them down and joins with a
bound. One thread per client connection, one fresh upstream connection per request (nginx's default
``proxy_pass``). Header values are never logged: logs name the method, the path without its query, the outcome.
"""

from __future__ import annotations

import http.client
import logging
import selectors
import socket
import socketserver
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Collection
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final, cast
from urllib.parse import urlsplit

from resilience.testing.faultplan import Decision, FaultDecider, FaultKind, FaultPlan

__all__ = ["FaultProxy", "InjectedFault", "SeenRequest"]

logger = logging.getLogger(__name__)

_HOP_BY_HOP: Final = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer", "trailers"}
    | {"transfer-encoding", "upgrade"}
)
_MAX_BODY: Final = 1 << 30  # 1 GiB: request bodies are buffered to be forwarded with a length
_MAX_TRAILERS: Final = 64
_CHUNK: Final = 64 * 1024
_POLL: Final = 0.05  # seconds: accept-loop and hang-loop granularity


@dataclass(frozen=True, slots=True)
class InjectedFault:
    """One fault the proxy injected, recorded when it decided it."""

    t_ns: int
    """``time.monotonic_ns()`` when the fault was decided."""
    path: str
    """Request path, without the query."""
    method: str
    kind: FaultKind
    status: int | None
    """Status answered in place of the engine's (status kinds and window), else None."""
    call_index: int
    """1-based index of the request among this engine's requests to ``path``."""
    engine_index: int
    rule_index: int
    """Index in ``plan.rules`` of the rule that fired."""


@dataclass(frozen=True, slots=True)
class SeenRequest:
    """One request the proxy received; each field is set before the client receives anything."""

    t_ns: int
    """``time.monotonic_ns()`` when the request arrived."""
    method: str
    path: str
    """Request path, without the query."""
    call_index: int
    """1-based index among this engine's requests to ``path``."""
    fault: FaultKind | None
    upstream_status: int | None
    """The engine's status, or None when it was not asked or did not answer."""
    client_status: int | None
    """The status the client received, or None (reset, hang, connection dropped)."""
    upstream_error: str | None
    """Why the engine did not answer (exception type, e.g. ``ConnectionRefusedError``): an upstream-caused 502/504."""


class _ClientGone(Exception):
    """The client connection was reset or closed by us; stop handling it."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # FaultProxy joins its threads itself, with a bound
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], proxy: FaultProxy) -> None:
        self.proxy = proxy
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a DNS lookup that can stall.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.proxy._spawn(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes
    server_version = "resilience-faultproxy"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        """Silenced: the stdlib logs the request line with its query; we log ourselves."""

    def _serve(self) -> None:
        proxy = cast(_Server, self.server).proxy
        try:
            proxy._handle(self)
        except _ClientGone:
            self.close_connection = True
        if proxy._stopping.is_set():
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _serve

    # -- helpers used by FaultProxy._handle -------------------------------------------

    def read_body(self) -> bytes | None:
        """The request body (chunked decoded), or None when the request has none."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        length = self.headers.get("Content-Length")
        if length is None:
            return None
        n = int(length) if length.strip().isdigit() else -1
        if not 0 <= n <= _MAX_BODY:
            self.close_connection = True
            self.answer(400 if n < 0 else 413)
            raise _ClientGone
        body = self.rfile.read(n)
        if len(body) != n:
            raise _ClientGone
        return body

    def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:  # bounded: every chunk adds to total, capped by _MAX_BODY
            line = self.rfile.readline(1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                self.close_connection = True
                self.answer(400)
                raise _ClientGone from None
            total += size
            if total > _MAX_BODY:
                self.close_connection = True
                self.answer(413)
                raise _ClientGone
            if size == 0:
                break
            data = self.rfile.read(size)
            self.rfile.readline(16)
            if len(data) != size:
                raise _ClientGone
            parts.append(data)
        for _ in range(_MAX_TRAILERS):
            if self.rfile.readline(8192) in (b"\r\n", b"\n", b""):
                break
        return b"".join(parts)

    def answer(self, status: int) -> None:
        """Answer ``status`` with an empty body (like nginx's 502 with ``response.text == ''``)."""
        self.send_response_only(status)
        self.send_header("Server", self.server_version)
        self.send_header("Date", self.date_time_string())
        self.send_header("Content-Length", "0")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()

    def reset(self) -> None:
        """Close the client connection abruptly: SO_LINGER 0 makes the kernel send a TCP RST."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        # The fd closes (and the RST goes out) only once the makefile'd rfile is closed too.
        self.rfile.close()
        self.connection.close()

    def client_gone(self) -> bool:
        """Whether the client closed its side (readable with nothing to read)."""
        try:
            with selectors.DefaultSelector() as sel:  # not select.select: fds may exceed 1024
                sel.register(self.connection, selectors.EVENT_READ)
                readable = bool(sel.select(0))
            return readable and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


@dataclass(slots=True)
class _Record:
    t_ns: int
    method: str
    path: str
    call_index: int = 0
    fault: FaultKind | None = None
    upstream_status: int | None = None
    client_status: int | None = None
    upstream_error: str | None = None


class FaultProxy:
    """A reverse proxy on ``host:port`` in front of ``upstream`` that injects ``plan``'s faults.

    - ``upstream``: the engine's base URL, ``http://host:port`` (a path prefix is prepended to every request path).
    - ``plan``: the faults; None = none (a transparent proxy).
    - ``engine_index``: this engine's index; selects rules (``engines``) and seeds draws.
    - ``host``/``port``: where to listen; default 127.0.0.1 and a free port.
    - ``upstream_timeout``: seconds to wait for the engine to connect or send each piece of its answer (default 60,
      nginx's ``proxy_read_timeout``); past it the client gets 504, recorded as upstream-caused.
    - ``idle_timeout``: seconds an idle keep-alive client connection is kept (default 75, nginx's ``keepalive_timeout``).
    - ``seen_limit``: how many of the latest requests :attr:`seen` and faults :attr:`injected` keep (default 1,000);
      :meth:`counts` and :meth:`injected_count` stay exact.

    A context manager, or :meth:`start` and :meth:`stop`. An engine that refuses or drops the connection gets the
    client a 502 with an empty body, recorded in :attr:`seen` with ``upstream_error`` set, never in :attr:`injected`.
    """

    def __init__(
        self,
        upstream: str,
        plan: FaultPlan | None = None,
        engine_index: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        upstream_timeout: float = 60.0,
        idle_timeout: float = 75.0,
        seen_limit: int = 1_000,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"`upstream` must be an http://host:port URL, but was {upstream!r}")
        if not upstream_timeout > 0 or not idle_timeout > 0:
            raise ValueError("`upstream_timeout` and `idle_timeout` must be > 0 seconds")
        self._up_host: Final = parts.hostname
        self._up_port: Final = parts.port or 80
        self._up_netloc: Final = parts.netloc.rsplit("@", 1)[-1]
        self._up_prefix: Final = parts.path.rstrip("/")
        self.plan: Final = plan if plan is not None else FaultPlan(seed=0)
        self._decider = FaultDecider(self.plan, engine_index)
        self.engine_index: Final = engine_index
        self._bind = (host, port)
        self._upstream_timeout = upstream_timeout
        self._idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._accept_thread: threading.Thread | None = None
        self._threads: set[threading.Thread] = set()
        self._clients: set[socket.socket] = set()
        self._upstreams: dict[http.client.HTTPConnection, str] = {}  # requests in flight to the engine -> their path
        self._settled = threading.Condition(self._lock)  # notified when no request is in flight to the engine
        self._injected: deque[InjectedFault] = deque(maxlen=seen_limit)
        self._injected_counts: Counter[str] = Counter()  # exact totals, however long the run
        self._seen: deque[_Record] = deque(maxlen=seen_limit)  # bounded: a soak must not grow with its length
        self._url: str | None = None
        self._conn_seq = 0
        self._thread_prefix = "faultproxy"

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> str:
        """Bind, start serving in background threads, and return the URL; ready on return."""
        with self._lock:
            if self._server is not None or self._stopping.is_set():
                raise RuntimeError("a FaultProxy starts once; create a new one")
            server = _Server(self._bind, self)
            self._server = server
        host, port = str(server.server_address[0]), int(server.server_address[1])
        self._url = f"http://{host}:{port}"
        self._thread_prefix = f"faultproxy-e{self.engine_index}-{port}"
        server.timeout = _POLL
        self._accept_thread = threading.Thread(target=self._accept_loop, args=(server,), name=f"{self._thread_prefix}-accept", daemon=True)
        self._accept_thread.start()
        return self._url

    def _accept_loop(self, server: _Server) -> None:
        while not self._stopping.is_set():  # each turn waits at most _POLL seconds
            try:
                server.handle_request()
            except OSError:
                if not self._stopping.is_set():
                    logger.exception("faultproxy: accept failed")
                    time.sleep(_POLL)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listener and every connection (hanging requests released, those in flight cut), and join every
        thread within ``timeout`` s; idempotent."""
        with self._lock:
            self._stopping.set()
            server, self._server = self._server, None
        deadline = time.monotonic() + timeout
        accept = self._accept_thread
        if accept is not None and accept.ident is not None:  # an interrupt may come between building it and starting it
            accept.join(max(0.0, deadline - time.monotonic()))
        if server is not None:
            server.server_close()
        with self._lock:
            clients, upstreams, threads = list(self._clients), list(self._upstreams), list(self._threads)
        for sock in clients:
            _shutdown(sock)
        for conn in upstreams:
            if conn.sock is not None:
                _shutdown(conn.sock)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in threads if t.is_alive()]
        if left:
            logger.warning("faultproxy: threads still running after stop(): %s", ", ".join(left))

    def settle(self, timeout: float = 10.0, paths: Collection[str] | None = None) -> bool:
        """Wait until no request (to ``paths``; None = any) is in flight to the engine; True then, False after ``timeout`` s.

        After a ``drop_after`` reset the engine may still be carrying the call out: whoever reads the engine's real
        state to reconcile calls this first. ``paths`` (e.g. the control paths) leaves out generation held by a
        paused engine.
        """
        deadline = time.monotonic() + timeout
        wanted = None if paths is None else frozenset(paths)
        with self._settled:
            while any(wanted is None or path in wanted for path in self._upstreams.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._settled.wait(left)
        return True

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- records ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://host:port`` of the proxy; raises RuntimeError before :meth:`start`."""
        if self._url is None:
            raise RuntimeError("the FaultProxy is not started")
        return self._url

    @property
    def injected(self) -> list[InjectedFault]:
        """The latest ``seen_limit`` faults injected (default 1,000), in decision order; ``injected_count`` is exact."""
        with self._lock:
            return list(self._injected)

    @property
    def seen(self) -> list[SeenRequest]:
        """The latest ``seen_limit`` requests (default 1,000), in arrival order (one still in flight shows what is known)."""
        with self._lock:
            return [
                SeenRequest(r.t_ns, r.method, r.path, r.call_index, r.fault, r.upstream_status, r.client_status, r.upstream_error)
                for r in self._seen
            ]

    def counts(self) -> dict[str, int]:
        """Injected faults counted by ``"kind:status:path"`` (status ``-`` when none),
        e.g. ``{"status_before:502:/pause_generation": 3}``."""
        with self._lock:
            return dict(sorted(self._injected_counts.items()))

    def injected_count(self, status: int | None = None) -> int:
        """Faults injected since start (exact, not limited by ``seen_limit``), optionally only those answering ``status``."""
        with self._lock:
            if status is None:
                return sum(self._injected_counts.values())
            return sum(n for key, n in self._injected_counts.items() if key.split(":")[1] == str(status))

    # -- connections --------------------------------------------------------------------

    def _spawn(self, request: socket.socket, client_address: Any) -> None:
        with self._lock:
            server = self._server
            if self._stopping.is_set() or server is None:
                _shutdown(request)
                request.close()
                return
            self._conn_seq += 1
            name = f"{self._thread_prefix}-conn-{self._conn_seq}"
            t = threading.Thread(target=self._run_connection, args=(server, request, client_address), name=name, daemon=True)
            self._clients.add(request)
            self._threads.add(t)
        t.start()

    def _run_connection(self, server: _Server, request: socket.socket, client_address: Any) -> None:
        try:
            request.settimeout(self._idle_timeout)
            server.finish_request(request, client_address)
        except (OSError, ValueError, _ClientGone):
            pass  # the client went away, or we reset it
        except Exception:
            logger.exception("faultproxy: connection handler failed")
        finally:
            server.shutdown_request(request)
            with self._lock:
                self._clients.discard(request)
                self._threads.discard(threading.current_thread())

    # -- one request --------------------------------------------------------------------

    def _handle(self, h: _Handler) -> None:
        target = h.path
        if not target.startswith("/") and target != "*":
            s = urlsplit(target)
            target = (s.path or "/") + (f"?{s.query}" if s.query else "")
        path = target.split("?", 1)[0]
        rec = _Record(t_ns=time.monotonic_ns(), method=h.command, path=path)
        body = h.read_body()
        decision = self._decider.decide(path)
        rec.call_index = decision.call_index
        with self._lock:
            self._seen.append(rec)  # filled in before any answer byte goes out
        if decision.kind is not None:
            self._record_fault(rec, decision)
        self._carry_out(h, target, body, decision, rec)

    def _record_fault(self, rec: _Record, d: Decision) -> None:
        assert d.kind is not None and d.rule_index is not None
        rec.fault = d.kind
        fault = InjectedFault(time.monotonic_ns(), d.path, rec.method, d.kind, d.status, d.call_index, self.engine_index, d.rule_index)
        with self._lock:
            self._injected.append(fault)
            self._injected_counts[f"{fault.kind}:{'-' if fault.status is None else fault.status}:{fault.path}"] += 1
        logger.debug("faultproxy e%d: %s %s #%d -> %s %s", self.engine_index, rec.method, d.path, d.call_index, d.kind, d.status or "")

    def _carry_out(self, h: _Handler, target: str, body: bytes | None, d: Decision, rec: _Record) -> None:
        kind = d.kind
        if kind in ("status_before", "window"):
            assert d.status is not None
            rec.client_status = d.status
            h.answer(d.status)
            return
        if kind == "reset_before":
            h.reset()
            return
        if kind == "hang":
            self._hang(h, d.delay)
            return
        if kind == "latency":
            assert d.delay is not None
            if self._stopping.wait(d.delay):
                h.reset()
                return
        buffered = kind in ("status_after", "reset_after", "drop_after", "hang_after")
        self._forward(h, target, body, d, rec, stream_to_client=not buffered, drop_client=kind == "drop_after")
        if rec.upstream_error is not None or kind == "drop_after":
            return  # the engine failed (the client already got nginx's 502/504), or the client was reset on sending
        if kind == "hang_after":
            self._hang(h, d.delay)  # the engine acted; the client waits for an answer that never comes
        elif kind == "reset_after":
            h.reset()
        elif kind == "status_after":
            assert d.status is not None
            rec.client_status = d.status
            h.answer(d.status)

    def _hang(self, h: _Handler, delay: float | None) -> None:
        h.close_connection = True
        until = None if delay is None else time.monotonic() + delay
        # Bounded: ends at stop(), at ``delay``, or when the client goes away.
        while not self._stopping.wait(_POLL):
            if (until is not None and time.monotonic() >= until) or h.client_gone():
                break

    def _forward(
        self, h: _Handler, target: str, body: bytes | None, d: Decision, rec: _Record, *, stream_to_client: bool, drop_client: bool = False
    ) -> None:
        """Send the request to the engine and read its answer: relayed, or read to its end and dropped (``drop_client``:
        the client reset as soon as the request is sent, the engine's whole answer still read)."""
        conn = http.client.HTTPConnection(self._up_host, self._up_port, timeout=self._upstream_timeout)
        with self._lock:
            if self._stopping.is_set():
                raise _ClientGone
            self._upstreams[conn] = d.path
        try:
            try:
                conn.connect()
                if self._stopping.is_set():
                    raise _ClientGone
                self._decider.forwarded(d)
                conn.putrequest(h.command, self._up_prefix + target, skip_host=True, skip_accept_encoding=True)
                for name, value in _end_to_end(h.headers.items(), extra={"host", "content-length", "expect"}):
                    conn.putheader(name, value)
                conn.putheader("Host", self._up_netloc)
                if body is not None:
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body)
                if drop_client:
                    h.reset()  # sent: the engine has the request, the client gets a reset
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                if self._stopping.is_set():
                    raise _ClientGone from None
                rec.upstream_error = type(exc).__name__
                if drop_client and h.connection.fileno() == -1:
                    return  # the client was already reset: nothing to answer
                status = 504 if isinstance(exc, TimeoutError) else 502
                why = rec.upstream_error
                logger.debug("faultproxy e%d: %s %s -> upstream %s, answering %d", self.engine_index, h.command, d.path, why, status)
                rec.client_status = status
                h.answer(status)
                return
            rec.upstream_status = resp.status
            if stream_to_client:
                self._relay(h, resp, rec)
            else:
                while resp.read1(_CHUNK):  # the engine acts and answers; the answer is dropped
                    pass
        except (OSError, http.client.HTTPException) as exc:
            if not self._stopping.is_set():
                logger.debug("faultproxy e%d: %s %s cut mid-answer: %s", self.engine_index, h.command, d.path, type(exc).__name__)
            h.reset()
            raise _ClientGone from None
        finally:
            with self._lock:
                self._upstreams.pop(conn, None)
                self._settled.notify_all()
            conn.close()

    def _relay(self, h: _Handler, resp: http.client.HTTPResponse, rec: _Record) -> None:
        h.send_response_only(resp.status, resp.reason)
        for name, value in _end_to_end(resp.getheaders(), extra={"content-length"}):
            h.send_header(name, value)
        no_body = h.command == "HEAD" or resp.status in (204, 304) or resp.status < 200
        length = resp.getheader("Content-Length")
        if no_body:
            if length is not None:
                h.send_header("Content-Length", length)
            rec.client_status = resp.status
            h.end_headers()
            return
        chunked = resp.length is None and h.request_version >= "HTTP/1.1"
        if resp.length is not None:
            h.send_header("Content-Length", str(resp.length))
        elif chunked:
            h.send_header("Transfer-Encoding", "chunked")
        else:
            h.send_header("Connection", "close")  # HTTP/1.0 client: the end is the close
        rec.client_status = resp.status
        h.end_headers()
        while True:  # bounded by the engine's finite answer; each read by upstream_timeout
            data = resp.read1(_CHUNK)
            if not data:
                break
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        if chunked:
            h.wfile.write(b"0\r\n\r\n")


def _end_to_end(headers: Any, *, extra: set[str]) -> list[tuple[str, str]]:
    """Headers minus hop-by-hop ones, those named in ``Connection``, and ``extra``."""
    items = [(str(k), str(v)) for k, v in headers]
    drop = _HOP_BY_HOP | extra
    for k, v in items:
        if k.lower() == "connection":
            drop = drop | {t.strip().lower() for t in v.split(",")}
    return [(k, v) for k, v in items if k.lower() not in drop]


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
