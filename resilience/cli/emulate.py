"""``cpr emulate``: run emulated SGLang (or, with ``--engine vllm``, vLLM 0.33.0) engines, checking the arguments with
the emulator's own parser first.

With ``--engine vllm`` the flags are vLLM's where vLLM has them (``--enable-sleep-mode``,
``--weight-transfer-config``, ``--api-key``, ``--host``, ``--port``), ``VLLM_SERVER_DEV_MODE`` comes
from the environment, and ``--engines N`` forks N engines from the shared zygote
(``resilience.testing.emulator.vllm``); ``--fault-plan`` is the SGLang engines' only.

Without ``--fault-plan`` the emulator serves as ``python -m resilience.testing.emulator`` does. With
``--fault-plan FILE`` each engine gets a :class:`~resilience.testing.faults.FaultProxy` on 127.0.0.1
in front of it, playing the plan: the ``EMULATOR READY <url>`` lines on stdout give the proxies' URLs
(what a client under test should use), and stderr lists each engine's own URL beside its proxy's.
``--port P`` then puts the proxies on P, P+1, ... (the engines take free ports). SIGINT or SIGTERM
stops the proxies, then the engines, by PID.

With ``--router smg`` the engines (behind their proxies, with ``--fault-plan``) are registered with a real
smg gateway on 127.0.0.1 (:class:`~resilience.testing.smg.SmgGateway`, the ``[smg]`` extra): one
``EMULATOR READY <url>`` line gives the gateway's URL (``--port P`` puts the gateway on P), and stderr
lists each engine's URL. SIGINT or SIGTERM stops the gateway, then the proxies and the engines.
SGLang engines only: smg 1.13.0 fans out SGLang's routes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

from resilience.cli.common import OneLineParser, add_router, plural

if TYPE_CHECKING:
    from resilience.testing.emulator import EngineConfig

__all__ = ["run_emulate", "run_emulate_vllm"]

_WATCH_S = 0.5
"""How often the proxied fleet looks for engines that died (each is reported once)."""


def _parser() -> argparse.ArgumentParser:
    from resilience.testing.emulator.server import build_parser as emulator_parser

    parser = emulator_parser("cpr emulate")
    parser.__class__ = OneLineParser  # same parser, one-line errors
    parser.add_argument(
        "--fault-plan",
        metavar="FILE",
        help="put a fault proxy on 127.0.0.1 in front of each engine, playing the fault plan FILE (.toml, .yaml, .json: "
        "a seed and rules, see resilience.testing.faults.FaultPlan); the READY lines then give the proxies' URLs and "
        "--port P puts the proxies on P, P+1, ... (default: no proxy)",
    )
    add_router(parser, "register the engines with a real smg gateway on 127.0.0.1 and print its URL (the [smg] extra)")
    return parser


def run_emulate(argv: Sequence[str]) -> int:
    """Check ``argv`` with the emulator's own parser (errors in one line, exit 2), then hand over to it (or serve behind proxies)."""
    from resilience.testing.emulator import main as emulator_main
    from resilience.testing.emulator.config import config_from_namespace

    parser = _parser()
    try:
        args = parser.parse_args(list(argv))
        config = config_from_namespace(args)
        if not 0 <= args.port <= 65535:
            parser.error(f"argument --port: must be a port number 0..65535, but was {args.port}")
        smg = args.router == "smg"
        if args.fault_plan is not None or smg:
            option = "--router smg" if smg else "--fault-plan"
            for flag, given in (("--host", args.host != "127.0.0.1"), ("--exit-with-parent", args.exit_with_parent is not None)):
                if given:
                    parser.error(f"argument {option}: not with {flag} (the engines serve on 127.0.0.1 until a signal)")
            proxied = args.engines if args.fault_plan is not None and not smg else 1  # ports the READY lines take
            if args.engines < 1 or (args.port and args.port + proxied - 1 > 65535):
                parser.error(f"argument --engines: must be >= 1 and fit ports {args.port}.. below 65536, but was {args.engines}")
    except SystemExit as exc:  # --help, or a one-line argument error
        return exc.code if isinstance(exc.code, int) else 0
    except ValueError as exc:
        print(f"cpr emulate: error: {exc}", file=sys.stderr)
        return 2
    if args.fault_plan is None and args.router == "direct":
        return emulator_main(_without_router(argv), prog="cpr emulate")
    return _serve_fleet(args, config)


def _without_router(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--router direct`` (the emulator's own parser does not take it)."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--router" and i + 1 < len(argv):
            skip = True
        elif not arg.startswith("--router="):
            out.append(arg)
    return out


def _serve_fleet(args: argparse.Namespace, config: EngineConfig) -> int:
    """Start ``args.engines`` engines, a fault proxy in front of each (``--fault-plan``) and an smg gateway in front of
    them all (``--router smg``); serve until SIGINT/SIGTERM."""
    from resilience.testing.emulator import EmulatedFleet, EmulatorStartError
    from resilience.testing.emulator.ready import READY_PREFIX
    from resilience.testing.emulator.serve_many import ProgressPrinter
    from resilience.testing.faults import FaultPlan, FaultPlanError, FaultProxy
    from resilience.testing.smg import SmgGateway, SmgStartError, smg_available

    smg = args.router == "smg"
    if smg and not smg_available():
        print("cpr emulate: error: --router smg needs smg: pip install 'controlplane-resilience[smg]'", file=sys.stderr)
        return 2
    plan = None
    try:
        plan = None if args.fault_plan is None else FaultPlan.load(args.fault_plan)
    except FaultPlanError as exc:
        print(f"cpr emulate: error: bad --fault-plan: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    fleet = EmulatedFleet(
        args.engines,
        config,
        startup_timeout=args.startup_timeout,
        progress=ProgressPrinter(),
        log_level=args.log_level,
        memory_state_dir=args.memory_state_dir,
    )
    proxies: list[FaultProxy] = []
    gateway: SmgGateway | None = None
    try:
        try:
            fleet.start()
        except EmulatorStartError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"cpr emulate: error: the engines did not start: {first}", file=sys.stderr)
            return 1
        fronts = [engine.direct_url for engine in fleet.engines]  # what stands in front of each engine
        if plan is not None:
            for engine in fleet.engines:
                port = args.port + engine.index if args.port and not smg else 0
                proxy = FaultProxy(engine.direct_url, plan, engine.index, port=port)
                proxies.append(proxy)
                try:
                    proxy.start()
                except OSError as exc:
                    print(f"cpr emulate: error: cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}", file=sys.stderr)
                    return 1
            fronts = [proxy.url for proxy in proxies]
            print(f"fault plan {args.fault_plan}: seed {plan.seed}, {plural(len(plan.rules), 'rule')}", file=sys.stderr)
        for engine, front in zip(fleet.engines, fronts, strict=True):
            behind = f" behind fault proxy {front}" if proxies else ""
            print(f"engine {engine.index}: {engine.direct_url}{behind}", file=sys.stderr)
        if smg:
            gateway = SmgGateway(fronts, port=args.port)
            try:
                gateway.start()
            except SmgStartError as exc:
                print(f"cpr emulate: error: the smg gateway did not start: {str(exc).splitlines()[0]}", file=sys.stderr)
                return 1
            print(f"smg gateway {gateway.url} (pid {gateway.pid}) in front of {plural(len(fronts), 'engine')}", file=sys.stderr)
        for url in [gateway.url] if gateway is not None else fronts if proxies else []:
            print(f"{READY_PREFIX}{url}")
        sys.stdout.flush()
        reported: set[int] = set()
        while not stop.wait(_WATCH_S):  # until SIGINT/SIGTERM
            for engine in fleet.engines:
                if engine.index not in reported and not engine.alive():
                    reported.add(engine.index)
                    print(f"engine {engine.index} ({engine.direct_url}) exited with {engine.returncode}", file=sys.stderr, flush=True)
        return 0
    finally:
        try:
            if gateway is not None:
                gateway.stop()
            for proxy in proxies:
                proxy.stop()
        finally:
            fleet.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_emulate_vllm(argv: Sequence[str]) -> int:
    """Check ``argv`` (which holds ``--engine vllm``) with the vLLM emulator's parser (one-line errors, exit 2), then serve."""
    from resilience.testing.emulator.server import main as emulator_main
    from resilience.testing.emulator.vllm.config import vllm_config_from_namespace
    from resilience.testing.emulator.vllm.server import build_parser

    parser = build_parser("cpr emulate")
    parser.__class__ = OneLineParser  # same parser, one-line errors
    add_router(parser, "SGLang engines only (smg 1.13.0 fans out SGLang's routes)")
    try:
        args = parser.parse_args(list(argv))
        if args.router == "smg":
            parser.error("argument --router: smg is for SGLang engines only (smg 1.13.0 fans out SGLang's routes)")
        argv = _without_router(argv)
        vllm_config_from_namespace(args).resolved_dev_mode()  # a bad VLLM_SERVER_DEV_MODE is named too
        if not 0 <= args.port <= 65535:
            parser.error(f"argument --port: must be a port number 0..65535, but was {args.port}")
    except SystemExit as exc:  # --help, or a one-line argument error
        return exc.code if isinstance(exc.code, int) else 0
    except ValueError as exc:
        print(f"cpr emulate: error: {exc}", file=sys.stderr)
        return 2
    return emulator_main(list(argv), prog="cpr emulate")
