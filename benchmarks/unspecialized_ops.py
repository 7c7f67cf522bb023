"""Which operations on one aiohttp request's success path through ours CPython left generic (not specialized).

Run: ``python benchmarks/unspecialized_ops.py [--calls 3000] [--observers]``

CPython 3.11 rewrites an instruction that keeps seeing the same kinds of
objects into a specialized one (a global's load, an instance attribute's,
a slot's); what it cannot specialize stays generic (an attribute of a class
object such as an enum member, a property, a method looked up on an
attribute, a class called). A generic lookup goes through the type's
attribute cache, which aiohttp's own few hundred lines between two of ours
leave cold: in a real call it costs 0.1-0.3 us where it costs tens of
nanoseconds in a hot loop (``benchmarks/NOTES.md``, "Core v3, sixth pass").
This script makes ``--calls`` sequential POSTs through
``ResilientMiddleware`` to the loopback server (``_loopback``, its own
process), reads every function of ours in its adaptive form
(``dis.get_instructions(adaptive=True)``), then traces one more request
instruction by instruction and prints, per function of ours it ran, the
executed instructions still generic, with their source line. The
instructions are read before the traced request (tracing runs the generic
forms). A ``CALL`` right after a ``PRECALL`` is left out (3.11: a
specialized ``PRECALL`` of a builtin makes the call itself). Measured by
hand; not run by ``run_all.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import dis
import gc
import linecache
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
from _loopback import LoopbackServer

from resilience.adapters.aiohttp import ResilientMiddleware
from resilience.policy import EndpointPolicy, PolicyTable

POLICIES = PolicyTable({"POST /flush_cache": EndpointPolicy()})
"""The route every call takes, as in ``bench_async_overhead.py``."""
ROOT = str(Path(__file__).resolve().parents[1])
GENERIC = frozenset({
    "LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "LOAD_GLOBAL", "BINARY_SUBSCR", "STORE_SUBSCR", "COMPARE_OP", "BINARY_OP",
    "PRECALL", "CALL", "UNPACK_SEQUENCE", "FOR_ITER",
})
"""Instructions that have specialized forms: under these names (or ``..._ADAPTIVE``, 3.11) they ran generic."""


def ours(code: types.CodeType) -> bool:
    """Code of this checkout's library (the benchmarks left out)."""
    return code.co_filename.startswith(ROOT) and "/benchmarks/" not in code.co_filename


def adaptive_forms() -> dict[types.CodeType, list[dis.Instruction]]:
    """Every function of ours alive now, as its instructions in their adaptive form."""
    found: dict[types.CodeType, list[dis.Instruction]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType) and ours(obj.__code__):
            found[obj.__code__] = list(dis.get_instructions(obj, adaptive=True))  # type: ignore[call-arg]
    return found


async def run(url: str, calls: int, observers: list[Any]) -> dict[types.CodeType, tuple[list[dis.Instruction], set[int]]]:
    """Per function of ours that one traced request ran: its adaptive instructions and the offsets it executed."""
    session = aiohttp.ClientSession(middlewares=(ResilientMiddleware(POLICIES, observers=observers),))

    async def call() -> None:
        async with session.post(url, data=b"{}") as response:
            await response.read()

    try:
        for _ in range(calls):
            await call()
        forms = adaptive_forms()
        executed: dict[types.CodeType, set[int]] = defaultdict(set)

        def trace(frame: types.FrameType, event: str, _arg: object) -> Any:
            if not ours(frame.f_code):
                return None
            frame.f_trace_opcodes = True
            if event == "opcode":
                executed[frame.f_code].add(frame.f_lasti)
            return trace

        sys.settrace(trace)
        try:
            await call()
        finally:
            sys.settrace(None)
    finally:
        await session.close()
    return {code: (forms[code], offsets) for code, offsets in executed.items() if code in forms}


def generic(instructions: list[dis.Instruction], offsets: set[int]) -> list[dis.Instruction]:
    """The executed instructions still generic (a ``CALL`` right after a ``PRECALL`` left out)."""
    out = []
    previous = ""
    for ins in instructions:
        name = ins.opname.removesuffix("_ADAPTIVE")
        if ins.offset in offsets and name in GENERIC and not (name == "CALL" and previous.startswith("PRECALL")):
            out.append(ins)
        previous = ins.opname
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000, help="sequential calls before the traced one (default 3000)")
    ap.add_argument("--observers", action="store_true", help="ours with MetricsObserver and TracingObserver (API, no SDK)")
    args = ap.parse_args(argv)
    observers: list[Any] = []
    if args.observers:
        from opentelemetry import trace

        from resilience.telemetry.metrics import MetricsObserver
        from resilience.telemetry.tracing import TracingObserver

        observers = [MetricsObserver(), TracingObserver(trace.NoOpTracerProvider())]
    with LoopbackServer() as server:
        found = asyncio.run(run(server.url + "/flush_cache", args.calls, observers))
    total = 0
    print(f"python {sys.version.split()[0]}; {args.calls} calls first; {'with' if observers else 'no'} observers")
    for code, (instructions, offsets) in found.items():
        left = generic(instructions, offsets)
        total += len(left)
        print(f"{code.co_qualname} ({code.co_filename.removeprefix(ROOT + '/')}): {len(offsets)} executed, {len(left)} generic")
        for ins in left:
            line = ins.positions.lineno if ins.positions and ins.positions.lineno else 0
            print(f"  {line:5d} {ins.opname} {ins.argrepr}: {linecache.getline(code.co_filename, line).strip()[:100]}")
    print(f"generic instructions executed in ours: {total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
