"""``StreamServer``: an HTTP/1.1 engine on 127.0.0.1 whose generation streams slowly and whose control routes answer at once.

What the control-lane tests and ``benchmarks/bench_control_lane.py`` run
against, in a child process of its own (``python -m resilience.testing.stream_server``: its CPU does not share the driver's
GIL; 1,000 streams fit in one event loop):

- a data route (``resilience.adapters.control_lane.DATA_PATHS``: ``/generate``,
  ``/v1/completions``, ...) answers 200 with a chunked ``text/event-stream``
  at once, then one ``data: {...}`` event every ``interval_s`` for ``events``
  events (0: until the client goes away; ``?events=N`` sets it for one
  request), then ``data: [DONE]``;
- any other route answers 200 ``{"success": true}`` at once.

Every response carries ``x-connection: N``, the number of the TCP connection
that served it (1, 2, ... in accept order), so a test can tell which pool a
request used. ``counts()`` asks the child for what it saw: connections open
now, connections accepted, streams open now, control requests served, and
the ``Authorization`` values the control requests carried (distinct, in
order: a test checks that a secret arrived unchanged).
"""

from __future__ import annotations

import asyncio
import json
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from types import TracebackType

from resilience.adapters.control_lane import DATA_PATHS

__all__ = ["StreamCounts", "StreamServer"]

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0
_CONTROL_BODY = b'{"success": true}'


@dataclass(frozen=True, slots=True)
class StreamCounts:
    """What a ``StreamServer`` saw so far."""

    open_connections: int
    accepted: int
    open_streams: int
    control_served: int
    authorizations: tuple[str, ...]


class _State:
    def __init__(self) -> None:
        self.open = 0
        self.accepted = 0
        self.streams = 0
        self.control = 0
        self.auth: list[str] = []


def _head(status: str, number: int, extra: str) -> bytes:
    return f"HTTP/1.1 {status}\r\nx-connection: {number}\r\n{extra}\r\n".encode()


async def _stream(writer: asyncio.StreamWriter, number: int, interval_s: float, events: int, state: _State) -> None:
    writer.write(_head("200 OK", number, "content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"))
    state.streams += 1
    try:
        sent = 0
        while events == 0 or sent < events:
            await asyncio.sleep(interval_s)
            chunk = b'data: {"text": "x"}\n\n'
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            sent += 1
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        await writer.drain()
    finally:
        state.streams -= 1


def _events(query: str, default: int) -> int:
    """``events=N`` in the query string overrides the server's ``events`` for one stream."""
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name == "events" and value.isdigit():
            return int(value)
    return default


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, interval_s: float, events: int, state: _State) -> None:
    state.open += 1
    state.accepted += 1
    number = state.accepted
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            target = lines[0].split(b" ")[1].decode("latin-1") if len(lines[0].split(b" ")) > 1 else "/"
            path, _, query = target.partition("?")
            length, auth = 0, None
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"authorization":
                    auth = value.strip().decode("latin-1")
            if length:
                await reader.readexactly(length)
            if path in DATA_PATHS:
                await _stream(writer, number, interval_s, _events(query, events), state)
                continue
            state.control += 1
            if auth is not None and auth not in state.auth:
                state.auth.append(auth)
            extra = f"content-type: application/json\r\ncontent-length: {len(_CONTROL_BODY)}\r\n"
            writer.write(_head("200 OK", number, extra) + _CONTROL_BODY)
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError, IndexError, asyncio.CancelledError):
        return  # the client went away, or we are stopping
    finally:
        state.open -= 1
        writer.close()


def _serve(interval_s: float, events: int) -> None:
    """The child: serve, print the port, then answer ``counts`` lines on stdin (JSON on stdout) until ``stop`` or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    state = _State()

    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: _handle(r, w, interval_s, events, state), "127.0.0.1", 0, backlog=4096, reuse_address=True
        )
        print(server.sockets[0].getsockname()[1], flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_message() -> None:
            line = sys.stdin.readline().strip()
            if line == "counts":
                print(json.dumps([state.open, state.accepted, state.streams, state.control, state.auth]), flush=True)
            else:
                stop.set()

        loop.add_reader(sys.stdin.fileno(), on_message)
        await stop.wait()
        loop.remove_reader(sys.stdin.fileno())
        server.close()

    asyncio.run(main())


class StreamServer:
    """The streaming engine in a child process; a context manager (leaving it stops the child by PID).

    ``interval_s``: seconds between a stream's events (default 0.5).
    ``events``: events per stream before ``[DONE]``; 0 = stream until the
    client goes away (default 0: a stream that holds its connection).
    ``url`` is ``http://127.0.0.1:<port>`` once started.
    """

    def __init__(self, interval_s: float = 0.5, events: int = 0) -> None:
        if not interval_s > 0:
            raise ValueError(f"StreamServer interval_s must be > 0, but was {interval_s!r}")
        if type(events) is not int or events < 0:
            raise ValueError(f"StreamServer events must be an int >= 0, but was {events!r}")
        self.interval_s = interval_s
        self.events = events
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` (no trailing slash)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The child's process id (0 when not running): what a benchmark reads the engine's CPU use by."""
        return self._proc.pid if self._proc is not None else 0

    def _line(self) -> str:
        """The child's next stdout line, waited for (bounded)."""
        assert self._proc is not None and self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], _START_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"stream server (pid {self._proc.pid}) did not answer within {_START_TIMEOUT_S} s")
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"stream server exited (exit code {self._proc.poll()})")
        return line

    def start(self) -> StreamServer:
        """Start the child (``python -m resilience.testing.stream_server``) and wait (bounded) for its port."""
        args = [sys.executable, "-m", "resilience.testing.stream_server", str(self.interval_s), str(self.events)]
        self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            self.port = int(self._line())
        except (RuntimeError, ValueError):
            self.stop()
            raise
        return self

    def counts(self) -> StreamCounts:
        """What the child saw so far."""
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write("counts\n")
        self._proc.stdin.flush()
        opened, accepted, streams, control, auth = json.loads(self._line())
        return StreamCounts(int(opened), int(accepted), int(streams), int(control), tuple(auth))

    def wait_for(self, check: str, value: int, timeout_s: float = 10.0) -> StreamCounts:
        """Poll (bounded) until ``counts().<check> == value``; the last counts. ``TimeoutError`` naming it otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = self.counts()
            if getattr(counts, check) == value:
                return counts
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream server: {check} stayed {getattr(counts, check)}, not {value}, for {timeout_s} s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the child: ask, wait, then terminate and kill it by PID. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        try:
            assert proc.stdin is not None
            proc.stdin.write("stop\n")
            proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            proc.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(_STOP_TIMEOUT_S)
        if proc.stdout is not None:
            proc.stdout.close()

    def __enter__(self) -> StreamServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


if __name__ == "__main__":
    _serve(float(sys.argv[1]), int(sys.argv[2]))
