"""A controller process for the crash-consistency tests: transitions on emulated engines, one JSON line per event.

    python tests/barrier/controller_main.py --seed S --transitions N [--journal PATH] [--ops offload,train]
                                            [--final] [--probe-dir DIR] [--async] URL...

It drives the engines at ``URL...`` (emulated SGLang engines that outlive it) through an
``Orchestrator`` over ``SGLangClient``s, on ``--journal PATH`` when given (else a fresh
orchestrator that knows nothing: the baseline). The test SIGKILLs it at random moments,
calls in flight included, and starts the next one on the same journal.

- ``--ops``: the transitions to run, comma-separated, from ``offload``, ``onload``,
  ``weight_sync`` and ``train`` (sleeps ``--train-s``: a window where a kill lands after a
  transition returned). Without it: ``--transitions`` random ones drawn with ``--seed``.
- ``--final``: end the run as a training job ends: release the holds a dead controller left
  (``unpause`` by reason, one token at a time), then ``onload()``; up to three rounds.
- ``--join URL``: the engine the ``join`` op adds (``add``: a new engine, or a known one again); a controller
  restarted after a join is given the joined engine among ``URL...`` (the journal names it).
- ``--async``: ``AsyncOrchestrator`` over ``AsyncSGLangClient`` (aiohttp) instead of ``Orchestrator``
  over ``SGLangClient``.
- ``--probe-dir DIR``: pass the emulator's memory probe over the engines' ``--memory-state-dir``
  (``resilience.testing.memory_probe``, a side channel, not HTTP) as ``memory_probe=``.

Stdout, one JSON object per line, flushed: ``{"event": "ready", "members", ...}`` once the orchestrator is
built (the journal read; ``members``: ``Recovery.members``, who joined and who left);
``{"event": "begin", "i", "op"}`` before each transition;
``{"event": "phase", "transition", "phase", "engines"}`` as each phase starts;
``{"event": "end", "i", "op", "ok", ...}`` after it (offload and onload: ``replaced``, the engines
taken as fresh processes, from ``TransitionReport.replaced``; ``ok`` false: ``error``, ``quarantined``,
``dead``, ``left_paused``, from ``PhaseFailed``); ``{"event": "final", "ok", ...}`` with
``--final``. A ``PhaseFailed`` never stops the run: the next transition is tried, as a
training loop would. Anything else ends the process with a traceback (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from resilience.adapters.sglang import SGLANG_POLICIES, AsyncSGLangClient, SGLangClient
from resilience.barrier import AsyncOrchestrator, EngineGroup, Orchestrator, PhaseDeadlines, PhaseFailed
from resilience.barrier.state import PhaseStarted
from resilience.barrier.transitions import OFFLOAD_HOLD
from resilience.events import Event
from resilience.testing import fast_policies

POLICIES = fast_policies(SGLANG_POLICIES, attempt_timeout_s=2.0, deadline_s=6.0)
"""SGLANG_POLICIES' decisions, with waits sized for emulated engines on loopback."""
DEADLINES = PhaseDeadlines(transition_s=30, pause_s=10, flush_s=10, release_s=10, resume_s=10, continue_s=10)
AnyOrchestrator = Orchestrator[Any] | AsyncOrchestrator[Any]
OPS = ("offload", "onload", "weight_sync")
WEIGHTS = (0.4, 0.4, 0.2)
"""How often each random transition is drawn."""
_MAX_HOLDS = 64
"""Bound on the orphaned holds one controller releases at its end."""


def emit(**fields: Any) -> None:
    """One JSON line on stdout, flushed at once (the test reads them while this process runs)."""
    sys.stdout.write(json.dumps(fields, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def announce(event: Event) -> None:
    """Observer: a ``phase`` line as each phase is handed to the fan-out (the test may kill the process right then)."""
    if isinstance(event, PhaseStarted):
        emit(event="phase", transition=event.transition, phase=event.phase, engines=list(event.engines))


def failed(exc: PhaseFailed) -> dict[str, Any]:
    """What a PhaseFailed names, as JSON fields."""
    return {
        "ok": False,
        "error": " ".join(str(exc).split())[:600],
        "failures": sorted(exc.failures),
        "quarantined": sorted(exc.quarantined),
        "dead": sorted(exc.dead),
        "left_paused": dict(exc.left_paused),
    }


async def _done(value: Any) -> Any:
    """The value of a sync call, or the awaited value of an async one (both orchestrators share this driver)."""
    return await value if inspect.isawaitable(value) else value


async def run_op(orch: AnyOrchestrator, op: str, args: argparse.Namespace) -> dict[str, Any]:
    """One transition; returns the JSON fields of its end."""
    if op == "train":
        await asyncio.sleep(args.train_s)
        return {"ok": True}
    try:
        if op == "offload":
            report = await _done(orch.offload(mode="abort"))
            return {"ok": True, "replaced": dict(report.replaced)}
        elif op == "join":
            report = await _done(orch.add(joining(orch, args)))
            return {"ok": True, "replaced": dict(report.replaced), "states": {k: str(v) for k, v in orch.states().items()}}
        elif op == "onload":
            report = await _done(orch.onload())
            return {"ok": True, "held": {k: list(v) for k, v in report.held.items()}, "replaced": dict(report.replaced)}
        elif op == "weight_sync":  # the body is the weight update: a window where a kill lands inside it
            if isinstance(orch, AsyncOrchestrator):
                async with orch.weight_sync(mode="retract"):
                    await asyncio.sleep(args.body_s)
            else:
                with orch.weight_sync(mode="retract"):
                    time.sleep(args.body_s)
        else:
            raise ValueError(f"unknown op {op!r}")
    except PhaseFailed as exc:
        return failed(exc)
    return {"ok": True}


def joining(orch: AnyOrchestrator, args: argparse.Namespace) -> Any:
    """The client of ``--join URL``, of the orchestrator's kind."""
    if not args.join:
        raise ValueError("the join op needs --join URL")
    if isinstance(orch, AsyncOrchestrator):
        return AsyncSGLangClient(args.join, policies=POLICIES, flush_poll_s=0.05)
    return SGLangClient(args.join, policies=POLICIES, flush_poll_s=0.05)


async def release_orphans(orch: AnyOrchestrator) -> list[str]:
    """Release every hold a dead controller left (by reason, latest first; the offload's own hold is onload's); bounded."""
    released: list[str] = []
    for _ in range(_MAX_HOLDS):
        reasons = sorted({r for reasons in orch.held().values() for r in reasons} - {OFFLOAD_HOLD})
        if not reasons:
            break
        await _done(orch.unpause(reasons[0]))
        released.append(reasons[0])
    return released


async def finish(orch: AnyOrchestrator) -> dict[str, Any]:
    """Bring every engine back to serving: release holds whose owner is gone, then onload (three rounds at most)."""
    result: dict[str, Any] = {"ok": False, "error": "not run"}
    for _ in range(3):
        try:
            orphans = await release_orphans(orch)
            report = await _done(orch.onload())
            held = {k: list(v) for k, v in report.held.items()}
            return {"ok": True, "held": held, "not_serving": orch.not_serving(), "orphans_released": orphans}
        except PhaseFailed as exc:
            result = failed(exc)
            if exc.quarantined or exc.dead:  # nothing more this controller can prove
                break
    return result


def build(args: argparse.Namespace) -> tuple[AnyOrchestrator, list[Any]]:
    """The orchestrator (on the journal, with the probe, when asked) and its clients."""
    extra: dict[str, Any] = {}
    if args.journal:
        extra["journal"] = args.journal
    if args.probe_dir:
        from resilience.testing.memory_probe import EmulatorMemoryProbe

        extra["memory_probe"] = EmulatorMemoryProbe(args.probe_dir)
    if args.use_async:
        aclients = [AsyncSGLangClient(url, policies=POLICIES, flush_poll_s=0.05) for url in args.urls]
        return AsyncOrchestrator(EngineGroup(aclients), deadlines=DEADLINES, observers=[announce], **extra), list(aclients)
    clients = [SGLangClient(url, policies=POLICIES, flush_poll_s=0.05) for url in args.urls]
    return Orchestrator(EngineGroup(clients), deadlines=DEADLINES, observers=[announce], **extra), list(clients)


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    ops = args.ops.split(",") if args.ops else rng.choices(OPS, WEIGHTS, k=args.transitions)
    orch, clients = build(args)
    recovery = orch.recovery
    emit(
        event="ready",
        states={k: str(v) for k, v in orch.states().items()},
        quarantined=sorted(orch.quarantined()),
        recovery=None if recovery is None else str(recovery),
        orphaned_holds=None if recovery is None else {k: list(v) for k, v in recovery.orphaned_holds.items()},
        members=None if recovery is None else dict(recovery.members),
    )
    try:
        for i, op in enumerate(ops):
            emit(event="begin", i=i, op=op)
            emit(event="end", i=i, op=op, **(await run_op(orch, op, args)))
        if args.final:
            emit(event="final", **(await finish(orch)))
    finally:
        for client in clients:
            await _done(client.aclose() if isinstance(client, AsyncSGLangClient) else client.close())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="controller_main", description=__doc__.split("\n", 1)[0])
    parser.add_argument("urls", nargs="+", help="the engines' URLs")
    parser.add_argument("--journal", default=None, help="the journal file (default: none, a fresh orchestrator)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random transitions (default 0)")
    parser.add_argument("--transitions", type=int, default=6, help="random transitions to run (default 6)")
    parser.add_argument("--ops", default=None, help="comma-separated transitions instead of random ones")
    parser.add_argument("--final", action="store_true", help="end with unpause of orphan holds and onload")
    parser.add_argument("--probe-dir", default=None, help="reconcile through the emulator's memory probe on this state folder")
    parser.add_argument("--train-s", type=float, default=30.0, help="how long a 'train' op sleeps (default 30)")
    parser.add_argument("--body-s", type=float, default=0.2, help="how long a weight_sync body runs (default 0.2)")
    parser.add_argument("--join", default=None, help="the engine URL the join op adds")
    parser.add_argument("--async", dest="use_async", action="store_true", help="AsyncOrchestrator over AsyncSGLangClient")
    args = parser.parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
