"""``cpr emulate --engines N``: N engines forked from one zygote, served until SIGINT/SIGTERM.

Progress (``engines ready i/N``) goes to stderr while the fleet starts; then one ``EMULATOR READY <url>`` line per
engine, in engine order, on stdout: the list of ports to point clients at. An engine that dies (SGLang's deaths) stays
dead, like a real one; its death is reported on stderr once, with the last lines of its log. SIGINT or SIGTERM stops
every engine and the zygote.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

from .config import EngineConfig
from .fleet import EmulatedFleet, EmulatorStartError
from .ready import READY_PREFIX

__all__ = ["ProgressPrinter", "serve_fleet", "serve_until", "stop_on_signal"]

if TYPE_CHECKING:
    from .vllm.config import VLLMEngineConfig

_WATCH_S = 0.5
_LOG_TAIL_LINES = 5
"""Lines of a dead engine's log shown with its death (its whole log lives in a folder removed at exit)."""


class ProgressPrinter:
    """A fleet's ``progress`` callback: ``engines ready i/N`` on stderr about ten times while it starts, and at N."""

    def __init__(self) -> None:
        self._shown = 0

    def __call__(self, ready: int, total: int) -> None:
        if ready == total or ready - self._shown >= max(1, total // 10):
            self._shown = ready
            print(f"engines ready {ready}/{total}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stop_on_signal() -> Iterator[threading.Event]:
    """An event that SIGINT or SIGTERM sets while the block runs; the previous handlers are back after it."""
    stop = threading.Event()

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_until(stop: threading.Event, fleet: EmulatedFleet, ready_urls: Iterable[str], log_lines: int = _LOG_TAIL_LINES) -> int:
    """Print one ``EMULATOR READY <url>`` line per ``ready_urls`` on stdout, then, until ``stop`` is set, report on
    stderr each engine of ``fleet`` that died, once, with the last ``log_lines`` lines of its log (default 5; 0: none).
    Returns 0."""
    for url in ready_urls:
        print(f"{READY_PREFIX}{url}")
    sys.stdout.flush()
    reported: set[int] = set()
    while not stop.wait(_WATCH_S):  # until SIGINT/SIGTERM
        for engine in fleet.engines:
            if engine.index not in reported and not engine.alive():
                reported.add(engine.index)
                tail = "".join(f"\n  {line}" for line in engine.log().splitlines()[-log_lines:]) if log_lines else ""
                print(f"engine {engine.index} ({engine.direct_url}) exited with {engine.returncode}{tail}", file=sys.stderr, flush=True)
    return 0


def serve_fleet(
    n: int,
    config: EngineConfig | VLLMEngineConfig,
    *,
    host: str,
    port: int,
    startup_timeout: float,
    log_level: str = "warning",
    memory_state_dir: str | None = None,
) -> int:
    """Start ``n`` engines (on ``port``, ``port + 1``, ... or free ports when ``port`` is 0), serve until a signal.

    ``memory_state_dir``: where every engine publishes its released tags (``--memory-state-dir``); None = the
    fleet's own folder, removed at exit.

    Returns 0 after a signal, 1 when the fleet did not start (the first failing engine's log on stderr).
    """
    with stop_on_signal() as stop:
        fleet = EmulatedFleet(
            n,
            config,
            startup_timeout=startup_timeout,
            progress=ProgressPrinter(),
            host=host,
            base_port=port,
            log_level=log_level,
            memory_state_dir=memory_state_dir,
        )
        try:
            try:
                fleet.start()
            except EmulatorStartError as exc:
                print(f"error: the engines did not start: {exc}", file=sys.stderr)
                return 1
            return serve_until(stop, fleet, fleet.direct_urls)
        finally:
            fleet.stop()
