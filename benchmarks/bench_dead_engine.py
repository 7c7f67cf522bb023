"""How long a call to a dead or mistyped engine takes before it fails, and what it fails with.

Run: ``.venv/bin/python benchmarks/bench_dead_engine.py [--calls pause,health,session,offload,second]``

Every call goes to ``http://127.0.0.1:<port>``, a loopback port held bound
without listening for the whole run, so each connect is refused at once and
nothing else can take the port (never another address). Each row is one
call, as a new user would write it, with the library's defaults:

- ``pause``: ``SGLangClient(url).pause_generation()``
- ``health``: ``SGLangClient(url).health()``
- ``session``: ``resilient_session().get(url, timeout=2)``
- ``offload``: ``Orchestrator(EngineGroup([SGLangClient(url)])).offload()``
- ``second``: a second ``pause_generation()`` on the same client right after the first (the breaker's turn)

A markdown section (heading, command, table of call, what it ended with,
attempts, wall seconds) goes to stdout, for ``run_all.py``; progress and the
library's WARNING lines to stderr. Issue 20's figures before the connect window:
178.6 s, 29.7 s, 28.6 s, 88.6 s.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from resilience.adapters.requests import resilient_session
from resilience.adapters.sglang import SGLangClient
from resilience.barrier import EngineGroup, Orchestrator

CALLS = ("pause", "health", "session", "offload", "second")


def _describe(value: object) -> str:
    if isinstance(value, BaseException):
        text = str(value).splitlines()[0] if str(value) else ""
        return f"{type(value).__name__}: {text[:90]}"
    healthy = getattr(value, "healthy", None)
    return f"healthy={healthy}" if healthy is not None else type(value).__name__


def _attempts(value: object) -> int | None:
    attempts = getattr(value, "attempts", None)
    if attempts is None and isinstance(value, BaseException):
        attempts = getattr(value.__cause__, "attempts", None)
    if not isinstance(attempts, tuple):
        return None
    return sum(1 for a in attempts if getattr(a, "error_type", None) != "CircuitOpen")  # a breaker's refusal sent nothing


def _timed(fn: Callable[[], Any]) -> tuple[object, float]:
    t0 = time.monotonic()
    try:
        value: object = fn()
    except Exception as exc:
        value = exc
    return value, time.monotonic() - t0


def measure(url: str, which: list[str]) -> list[tuple[str, str, int | None, float]]:
    """One row per call: (what was called, how it ended, attempts, seconds)."""
    rows: list[tuple[str, str, int | None, float]] = []
    for name in which:
        print(f"... {name}", file=sys.stderr, flush=True)
        if name == "pause" or name == "second":
            with SGLangClient(url) as client:
                value, wall = _timed(client.pause_generation)
                if name == "second":
                    value, wall = _timed(client.pause_generation)
            label = "SGLangClient(url).pause_generation()" + (" again, right after" if name == "second" else "")
        elif name == "health":
            with SGLangClient(url) as client:
                value, wall = _timed(client.health)
            label = "SGLangClient(url).health()"
        elif name == "session":
            with resilient_session() as session:
                value, wall = _timed(lambda: session.get(f"{url}/health", timeout=2))
            label = "resilient_session().get(url, timeout=2)"
        else:
            with SGLangClient(url) as client:
                value, wall = _timed(Orchestrator(EngineGroup([client])).offload)
            label = "Orchestrator(EngineGroup([SGLangClient(url)])).offload()"
        rows.append((label, _describe(value), _attempts(value), wall))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", default=",".join(CALLS), help=f"comma-separated subset of {','.join(CALLS)}")
    args = parser.parse_args(argv)
    which = [c for c in args.calls.split(",") if c]
    unknown = sorted(set(which) - set(CALLS))
    if unknown:
        parser.error(f"--calls: unknown {', '.join(unknown)}; choose from {', '.join(CALLS)}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    with socket.socket() as held:  # bound, never listening: every connect is refused, and no one else can take the port
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        rows = measure(url, which)
    print("## A dead or mistyped engine: how long until the call fails\n")
    print("`.venv/bin/python benchmarks/bench_dead_engine.py`: each call as a new user writes it, with the defaults, against a")
    print("loopback port held bound without listening (every connect refused). The connect window (`RetryPolicy.connect_window_s`,")
    print("5 s by default and in the SGLang preset) bounds a call that never connected; the breaker then fails the next call fast.")
    print("Before the window (issue 20): 178.6 s, 29.7 s, 28.6 s and 88.6 s for the first four rows.\n")
    print("| call | ended with | attempts | wall s |")
    print("|---|---|---:|---:|")
    for label, ended, attempts, wall in rows:
        print(f"| `{label}` | {ended} | {'' if attempts is None else attempts} | {wall:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
